"""``megatrain train --task dpo`` and ``--task grpo`` (megatrain.train.rl_tasks): preference data as
TRL and LLaMA-Factory write it, the runs on the CPU on a bundled tiny model, their metrics as TRL
defines them, and bad input refused with one error and no update."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import megatrain
from megatrain.data.preference import detect_preference_format, iter_pairs, resolve_preference_data, to_pair
from megatrain.data.sft_formats import Chat, Completion, RecordError
from megatrain.errors import BatchError, ConfigError, MegatrainError
from megatrain.rl import DPOLoss, GRPOLoss, target_mask
from megatrain.rl.rewards import arithmetic_reward, exact_match_reward, load_reward, score
from megatrain.train import load_train_config, train
from megatrain.train import rl_tasks

from conftest import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
MODEL = str(ROOT / "examples" / "tiny_llama_rl.json")


def _cfg(tmp_path, **kw):
    base = dict(model=MODEL, output_dir=str(tmp_path / "run"), warmup_steps=0, device="cpu", threads=1,
                checkpoint_interval=0)
    return load_train_config(None, {**base, **kw})


# ---------------------------------------------------------------------------------------------
# Preference data
# ---------------------------------------------------------------------------------------------

def _first_pair(data: str):
    (source, *_) = resolve_preference_data(data)
    chosen, rejected, _ = next(iter_pairs(source))
    return chosen, rejected


def test_every_preference_format_reads_the_same_pair():
    """The four bundled files hold the same 48 pairs; TRL conversational, LLaMA-Factory alpaca and
    sharegpt ranking data give the same chats, TRL's plain strings the prompt + response text."""
    conv = _first_pair(str(DATA / "preference" / "trl_conversational_demo.jsonl"))
    alpaca = _first_pair(f"alpaca_ranking_demo@{DATA / 'preference'}")
    sharegpt = _first_pair(f"sharegpt_ranking_demo@{DATA / 'preference'}")
    plain = _first_pair(str(DATA / "preference" / "trl_demo.jsonl"))
    assert all(isinstance(x, Chat) for x in (*conv, *alpaca, *sharegpt))
    for side in range(2):
        assert conv[side].messages == alpaca[side].messages == sharegpt[side].messages
        assert [m["role"] for m in conv[side].messages] == ["user", "assistant"]
        assert isinstance(plain[side], Completion)
        assert plain[side].prompt.strip() == conv[side].messages[0]["content"]
        assert plain[side].completion == conv[side].messages[1]["content"]
    assert conv[0].messages[1] != conv[1].messages[1]  # chosen and rejected differ
    # The registry directory is every ranking entry: 48 pairs each.
    assert [s.name for s in resolve_preference_data(str(DATA / "preference"))] == ["alpaca_ranking_demo",
                                                                                   "sharegpt_ranking_demo"]
    assert sum(1 for s in resolve_preference_data(str(DATA / "preference")) for _ in iter_pairs(s)) == 96


def test_a_preference_registry_reads_nothing_outside_its_directory(tmp_path):
    """Issue 44, item 2, for --task dpo: a ranking entry's file_name that climbs out, is absolute or
    is a symlink to outside, and a symlinked file in a directory entry, are refused as SFT
    registries refuse them (sft_sources.entry_path / entry_files); an entry inside reads."""
    import re

    from megatrain.files import UnsafeFileError

    outside = tmp_path / "outside"
    outside.mkdir()
    pair = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n"
    (outside / "x.jsonl").write_text(pair)
    d = tmp_path / "reg"
    (d / "parts").mkdir(parents=True)
    (d / "in.jsonl").write_text(pair)
    (d / "link.jsonl").symlink_to(outside / "x.jsonl")
    (d / "parts" / "0.jsonl").write_text(pair)
    (d / "parts" / "1.jsonl").symlink_to(outside / "x.jsonl")
    entries = {"up": "../outside/x.jsonl", "root": "/", "link": "link.jsonl", "parts": "parts", "in": "in.jsonl"}
    (d / "dataset_info.json").write_text(json.dumps({k: {"file_name": v, "ranking": True} for k, v in entries.items()}))
    for name, resolves in [("up", outside / "x.jsonl"), ("root", Path("/")), ("link", outside / "x.jsonl"),
                           ("parts", outside / "x.jsonl")]:
        with pytest.raises(UnsafeFileError, match=rf"dataset '{name}': file(_name)?: '.*' resolves to "
                                                  rf"{re.escape(str(resolves.resolve()))}, outside"):
            resolve_preference_data(f"{name}@{d}")
    assert [s.name for s in resolve_preference_data(f"in@{d}")] == ["in"]


def test_a_preference_registry_entry_is_checked_as_an_sft_entry_is(tmp_path):
    """A ranking entry's directory with no data files, of mixed file types, or a split on data
    files gets the SFT registry's error naming the entry (sft_sources.entry_source), not an
    IndexError or a silently ignored split; the same entries as SFT data get the same errors."""
    from megatrain.data.sft_sources import resolve_sft_data

    d = tmp_path / "reg"
    (d / "empty").mkdir(parents=True)
    (d / "mixed").mkdir()
    pair = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    (d / "mixed" / "a.jsonl").write_text(pair + "\n")
    (d / "mixed" / "b.csv").write_text("prompt,chosen,rejected\np,a,b\n")
    (d / "one.jsonl").write_text(pair + "\n")
    entries = {"empty": {"file_name": "empty"}, "mixed": {"file_name": "mixed"},
               "split": {"file_name": "one.jsonl", "split": "test"}}
    (d / "dataset_info.json").write_text(json.dumps({k: {**v, "ranking": True} for k, v in entries.items()}))
    for name, (error, match) in {"empty": (FileNotFoundError, "holds no"), "mixed": (ValueError, "mixes file types"),
                                 "split": (ValueError, "split 'test'")}.items():
        with pytest.raises(error, match=rf"dataset '{name}'.*{match}"):
            resolve_preference_data(f"{name}@{d}")
    (d / "dataset_info.json").write_text(json.dumps(entries))  # the same entries, as SFT data
    for name, match in {"empty": "holds no", "mixed": "mixes file types", "split": "split 'test'"}.items():
        with pytest.raises((FileNotFoundError, ValueError), match=rf"dataset '{name}'.*{match}"):
            resolve_sft_data(f"{name}@{d}")


def test_trl_implicit_prompt_is_the_common_prefix():
    user = {"role": "user", "content": "2+2?"}
    rec = {"chosen": [user, {"role": "assistant", "content": "4"}],
           "rejected": [user, {"role": "assistant", "content": "5"}]}
    fmt = detect_preference_format(rec)
    assert fmt.kind == "trl"
    chosen, rejected = to_pair(rec, fmt)
    assert chosen.messages == (user, {"role": "assistant", "content": "4"}) and chosen.train == (False, True)
    assert rejected.messages[1]["content"] == "5"


@pytest.mark.parametrize("record, match", [
    ({"prompt": "q", "chosen": "a"}, "'rejected' .*missing"),
    ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "chosen response is empty"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": ""}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "chosen response is empty"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]},
     "share no leading message"),
    ({"instruction": "q", "chosen": "a", "rejected": ""}, "rejected response is empty"),
])
def test_bad_preference_records_are_one_error_naming_the_field(record, match):
    with pytest.raises(RecordError, match=match):
        to_pair(record, detect_preference_format(record))


def test_a_bad_record_stops_the_dpo_run_before_the_model_is_built(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    good = {"prompt": "q ", "chosen": "yes", "rejected": "no"}
    bad.write_text("\n".join(json.dumps(r) for r in [good, good, {"prompt": "q ", "chosen": "yes"}]) + "\n")
    with pytest.raises(ConfigError, match=r"pairs.jsonl', record 3 \(line 3\).*'rejected'"):
        train(_cfg(tmp_path, task="dpo", data=str(bad), seq_len=32, global_batch=2, micro_batch_size=2, max_steps=1))
    assert not (tmp_path / "run" / "checkpoint").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(task="grpo", group_size=1), "group_size=1: GRPO compares"),
    (dict(task="grpo", group_size=3, global_batch=8), "groups of group_size=3"),
    (dict(task="dpo", global_batch=6, micro_batch_size=3), "make both even"),
    (dict(task="grpo", seq_len=8, max_new_tokens=8), "no room for a prompt"),
    (dict(task="dpo", micro_batch_size=2, loss_spike=3.0), "loss_spike=3.0 with task dpo: the spike check is not"),
])
def test_rl_settings_are_refused_before_anything_runs(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, data="x", **kw)


def test_train_help_lists_the_rl_tasks_and_their_flags(capsys):
    from megatrain.cli import main

    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "{lm,sft,dpo,grpo}" in text
    for flag in ("--reward", "--kl-coef", "--group-size", "--dpo-beta", "--dpo-reference", "--max-new-tokens",
                 "--grpo-updates", "--clip-low"):
        assert flag in text


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

def test_the_arithmetic_reward_is_exact_match_plus_a_format_reward():
    got = arithmetic_reward(["3+4="] * 5, ["7", " 7 and", "8", "x7", ""], answer=["7"] * 5)
    assert got == [1.0, 1.0, 0.1, 0.0, 0.0]
    assert load_reward("megatrain.rl.rewards:arithmetic_reward") is arithmetic_reward
    for spec, match in (("nocolon", "module:function"), ("no_such_module_x:f", "cannot be imported"),
                        ("megatrain.rl.rewards:nope", "no function 'nope'")):
        with pytest.raises(ConfigError, match=match):
            load_reward(spec)


def test_the_exact_match_reward_is_the_accuracy():
    got = exact_match_reward(["3+4="] * 6, ["7", " 7 and", "8", "x7", "", "71"], answer=["7"] * 6)
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert load_reward("megatrain.rl.rewards:exact_match_reward") is exact_match_reward


def _raises(prompts, completions, **kw):
    raise KeyError("answer")


@pytest.mark.parametrize("fn, match", [
    (_raises, "raised KeyError"),
    (lambda p, c, **kw: [float("nan")] * len(c), "returned nan for completion 0"),
    (lambda p, c, **kw: [1.0], "returned 1 rewards for 2 completions"),
    (lambda p, c, **kw: ["good", "bad"], "list of numbers"),
])
def test_a_bad_reward_is_one_batch_error(fn, match):
    with pytest.raises(BatchError, match=match):
        score(fn, ["a", "b"], ["x", "y"], {}, name="reward f")


# ---------------------------------------------------------------------------------------------
# Metrics as TRL defines them, against eager PyTorch
# ---------------------------------------------------------------------------------------------

def _eager_logps(model, batch):
    """TRL's per-token log-probabilities: log_softmax of the logits gathered at the next token,
    masked to the labels, aligned as Trainer.logprobs (``out[:, t]`` predicts ``labels[:, t]``)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits.float()
    labels = batch["labels"]
    lp = torch.zeros(labels.shape)
    tgt = labels[:, 1:].clamp(min=0)
    lp[:, 1:] = F.log_softmax(logits[:, :-1], -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    return torch.where(target_mask(labels), lp, torch.zeros_like(lp))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_metrics_are_trls_on_eager_log_probabilities(loss_type):
    torch.manual_seed(0)
    model = tiny_llama()
    eager = tiny_llama()
    eager.load_state_dict(model.state_dict())
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, micro_batches=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    labels = ids.clone()
    labels[:, :6] = -100
    labels[1, 12:] = -100  # a shorter rejected response
    batch = {"input_ids": ids, "labels": labels}
    ref = torch.randn(4, 16, generator=g) * target_mask(labels)
    loss = DPOLoss(beta=0.3, loss_type=loss_type)
    got = rl_tasks.dpo_metrics(loss, trainer.logprobs(batch), target_mask(labels), ref)
    # TRL DPOTrainer: chosen_rewards = beta * (chosen_logps - ref_chosen_logps), logps the sums over
    # the completion (per-token means for IPO); accuracies = (chosen_rewards > rejected_rewards).
    lp, m = _eager_logps(eager, batch), target_mask(labels)
    agg = (lambda x: (x * m).sum(1) / m.sum(1)) if loss_type == "ipo" else (lambda x: (x * m).sum(1))
    r = 0.3 * (agg(lp) - agg(ref))
    want = {"rewards_chosen": r[0::2].mean(), "rewards_rejected": r[1::2].mean(),
            "rewards_accuracy": (r[0::2] > r[1::2]).float().mean(), "rewards_margin": (r[0::2] - r[1::2]).mean()}
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), abs=1e-5), k


def test_grpo_kl_and_clip_fraction_are_trls():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 8, generator=g)
    old = logp + 0.4 * torch.randn(4, 8, generator=g)
    ref = logp + 0.1 * torch.randn(4, 8, generator=g)
    mask = torch.ones(4, 8, dtype=torch.bool)
    mask[:, :3] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    a = adv.tolist()
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.1)
    got = rl_tasks.grpo_metrics(loss, logp, mask, {"ref_logprobs": ref, "old_logprobs": old, "advantages": adv})
    # TRL GRPOTrainer: per_token_kl = exp(ref - logp) - (ref - logp) - 1; is_low_clipped = (coef_1 <
    # 1 - epsilon_low) & (advantages < 0); is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0).
    kl, n = 0.0, 0
    clipped = 0
    for b in range(4):
        for t in range(3, 8):
            d = float(ref[b, t] - logp[b, t])
            kl += math.exp(d) - d - 1
            r = math.exp(float(logp[b, t] - old[b, t]))
            clipped += (r < 0.8 and a[b] < 0) or (r > 1.28 and a[b] > 0)
            n += 1
    assert got["kl"] == pytest.approx(kl / n, rel=1e-5)
    assert got["clip_fraction"] == pytest.approx(clipped / n, abs=1e-7)
    assert 0 < clipped < n  # the draw exercises both sides


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------

def _rows(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("data, reference", [
    (str(DATA / "preference" / "trl_conversational_demo.jsonl"), "precompute"),
    (f"alpaca_ranking_demo@{DATA / 'preference'}", "bfloat16"),
])
def test_dpo_runs_on_the_cpu_and_its_first_step_is_log_2(tmp_path, data, reference):
    """At step 1 the policy is the reference: every margin is 0, the loss log 2, the accuracy 0
    (TRL counts chosen > rejected); precomputed exactly, a BF16 reference within its rounding."""
    res = train(_cfg(tmp_path, task="dpo", data=data, seq_len=64, global_batch=8, micro_batch_size=4, max_steps=3,
                     lr=3e-3, dpo_reference=reference))
    rows = _rows(tmp_path)
    assert res.step == 3 and [r["step"] for r in rows] == [1, 2, 3] and all(r["applied"] for r in rows)
    assert set(rl_tasks.DPO_FIELDS) <= set(rows[0])
    if reference == "precompute":
        assert rows[0]["rewards_margin"] == 0.0 and rows[0]["rewards_accuracy"] == 0.0
        assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    else:  # BF16 weights: each log-prob off by a few 2^-9 relative steps of the weights' rounding
        assert abs(rows[0]["rewards_margin"]) < 0.05 and rows[0]["loss"] == pytest.approx(math.log(2), abs=0.02)
    assert rows[2]["rewards_margin"] != rows[0]["rewards_margin"]  # it trained
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0


def test_grpo_runs_on_the_cpu_with_its_metrics(tmp_path):
    res = train(_cfg(tmp_path, task="grpo", data=str(DATA / "rl" / "arithmetic.jsonl"), seq_len=12, max_new_tokens=3,
                     global_batch=16, micro_batch_size=8, group_size=4, max_steps=4, lr=2e-3, kl_coef=0.05,
                     grpo_updates=2))
    rows = _rows(tmp_path)
    assert res.step == 4 and len(rows) == 4 and all(r["applied"] for r in rows)
    for r in rows:
        assert set(rl_tasks.GRPO_FIELDS) <= set(r)
        assert 0 <= r["reward_mean"] <= 1 and 1 <= r["response_length"] <= 3
        assert r["kl"] is not None and r["kl"] >= 0
    # Updates 1 and 3 start from the rollout policy (ratio 1, nothing clipped); 2 and 4 are measured.
    assert rows[0]["clip_fraction"] == rows[2]["clip_fraction"] == 0.0
    assert rows[0]["reward_mean"] == rows[1]["reward_mean"]  # one batch of rollouts, two updates
    # At step 1 the policy is the initial model and the reference its BF16 copy: KL ~ rounding only.
    assert rows[0]["kl"] < 1e-3
    assert (tmp_path / "run" / "loss.png").is_file()


def _tiny_grpo(tmp_path):
    """A trainer, the bundled prompts tokenised by a BPE trained on them, and a Rollout."""
    from megatrain.train.model import resolve_model

    cfg = _cfg(tmp_path, task="grpo", data=str(DATA / "rl" / "arithmetic.jsonl"), seq_len=12, max_new_tokens=3,
               global_batch=8, micro_batch_size=8, group_size=4, max_steps=1)
    tokenizer, eot, prompts, _, _ = rl_tasks.prepare_prompts(cfg, resolve_model(cfg.model), lambda _l: None)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MODEL))
    trainer = megatrain.compile(model, seq_len=12, micro_batch_size=8, micro_batches=1)
    rollout = rl_tasks.Rollout(trainer, tokenizer.token_to_id(eot), max_new_tokens=3, temperature=1.0)
    return trainer, tokenizer, prompts, rollout


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.state_dict()["model"].items()}


def test_a_rollout_batch_supervises_exactly_the_responses(tmp_path):
    trainer, tokenizer, prompts, rollout = _tiny_grpo(tmp_path)
    batch, rewards, lengths = rl_tasks.grpo_batch(rollout, tokenizer, prompts, [0, 1], group_size=4, seq_len=12,
                                                  reward=arithmetic_reward, reward_name="r", seed=0)
    assert batch["input_ids"].shape == batch["labels"].shape == (8, 12) and rewards.shape == (8,)
    assert all(1 <= n <= 3 for n in lengths) and int(target_mask(batch["labels"]).sum()) == sum(lengths)
    for row in range(8):  # the prompt, then the response (its labels), then end-of-text padding
        p = prompts.ids[[0, 1][row // 4]]
        assert batch["input_ids"][row, :len(p)].tolist() == p
        assert (batch["labels"][row, :len(p)] == -100).all()
        assert (batch["labels"][row, len(p):len(p) + lengths[row]] >= 0).all()
    assert batch["advantages"].shape == (8,) and abs(float(batch["advantages"][:4].sum())) < 1e-5


@pytest.mark.parametrize("reward, match", [
    (_raises, "raised KeyError"),
    (lambda p, c, **kw: [float("nan")] * len(c), "returned nan"),
])
def test_a_bad_reward_gets_one_error_and_no_update(tmp_path, reward, match):
    trainer, tokenizer, prompts, rollout = _tiny_grpo(tmp_path)
    before = _weights(trainer)
    with pytest.raises(BatchError, match=match):
        rl_tasks.grpo_batch(rollout, tokenizer, prompts, [0, 1], group_size=4, seq_len=12, reward=reward,
                            reward_name="r", seed=0)
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_raising_reward_stops_the_grpo_run_at_its_step_with_nothing_applied(tmp_path):
    mod = tmp_path / "bad_reward_mod.py"
    mod.write_text("def reward(prompts, completions, **kw):\n    raise ValueError('no answer column')\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(BatchError, match="step 1: reward bad_reward_mod:reward raised ValueError: no answer "
                                             "column; nothing of step 1 was applied"):
            train(_cfg(tmp_path, task="grpo", data=str(DATA / "rl" / "arithmetic.jsonl"), seq_len=12,
                       max_new_tokens=3, global_batch=8, micro_batch_size=8, group_size=4, max_steps=2,
                       reward="bad_reward_mod:reward"))
    finally:
        sys.path.remove(str(tmp_path))
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not _rows(tmp_path)
    assert not (tmp_path / "run" / "checkpoint").exists()
    # The same output_dir takes the run again (it saved nothing to resume from); another run is refused.
    lines = []
    train(_cfg(tmp_path, task="grpo", data=str(DATA / "rl" / "arithmetic.jsonl"), seq_len=12, max_new_tokens=3,
               global_batch=8, micro_batch_size=8, group_size=4, max_steps=1), echo=lines.append)
    assert any("stopped before its first complete checkpoint; starting it again" in line for line in lines)
    assert len(_rows(tmp_path)) == 1
    with pytest.raises(ConfigError, match="holds another run .*task='grpo' there, 'dpo' now"):
        train(_cfg(tmp_path, task="dpo", data=str(DATA / "preference" / "trl_demo.jsonl"), seq_len=64,
                   global_batch=2, micro_batch_size=2, max_steps=1))


@pytest.mark.parametrize("name", ["grpo_arithmetic.yaml", "dpo_preference.yaml"])
def test_the_example_configs_run(tmp_path, name):
    cfg = load_train_config(ROOT / "examples" / name, {"output_dir": str(tmp_path / "run"), "max_steps": 2,
                                                         "threads": 1})
    assert train(cfg).step == 2 and len(_rows(tmp_path)) == 2


def test_the_grpo_accuracy_rises_on_the_bundled_arithmetic_task(tmp_path):
    """examples/grpo_arithmetic.yaml (the 55 sums below 10, one-token answers, the exact-match
    reward: the mean reward is the exact-match accuracy) for 100 steps. Measured on this project's
    2-core VM (2026-12-02, bench/grpo_seeds.py, seeds 0-7, one thread): the accuracy of steps 1-20
    was 0.077-0.092 (chance: about one token in 13) and of steps 81-100 0.255-0.323, 2.8-4.2x it
    (and 0.37-0.90 at steps 281-300 of the example's 300). The bound: steps 81-100 at
    least 0.21, above the 10/55 = 0.18 of one answer for every prompt (9, the most frequent sum: a
    collapsed policy) and 0.045 under the lowest seed, and 2x steps 1-20 (the lowest seed's ratio 2.8)."""
    cfg = load_train_config(ROOT / "examples" / "grpo_arithmetic.yaml",
                            {"output_dir": str(tmp_path / "run"), "max_steps": 100, "threads": 1})
    train(cfg, echo=lambda _line: None)
    r = [row["reward_mean"] for row in _rows(tmp_path)]
    first, last = sum(r[:20]) / 20, sum(r[-20:]) / 20
    assert last >= 0.21 and last >= 2 * first, r


def test_the_bundled_grpo_task_has_one_token_answers(tmp_path):
    """Every prompt of examples/data/rl/sums_below_10.jsonl fits, and every answer is one token of the
    bundled tokenizer (what max_new_tokens: 1 generates), scored 1 by the exact-match reward."""
    from megatrain.train.model import resolve_model

    cfg = load_train_config(ROOT / "examples" / "grpo_arithmetic.yaml", {"output_dir": str(tmp_path / "run")})
    tokenizer, eot, prompts, _, _ = rl_tasks.prepare_prompts(cfg, resolve_model(cfg.model), lambda _l: None)
    assert len(prompts.ids) == 55 and prompts.dropped == 0 and eot == "<|endoftext|>"
    answers = prompts.columns["answer"]
    assert all(len(tokenizer.encode(a).ids) == 1 for a in answers)
    assert exact_match_reward(prompts.prompts, answers, answer=answers) == [1.0] * 55


def test_dpo_rows_share_the_prompt_and_supervise_only_the_responses(tmp_path):
    """Each pair's two rows: the same prompt tokens (the chat template's render of the user turn and
    the assistant header, unsupervised), then each response and its end of text as the only labels,
    right-padded; as SFT tokenises the same chat with loss on the last assistant turn."""
    from megatrain import data as D
    from megatrain.train.model import resolve_model

    cfg = _cfg(tmp_path, task="dpo", data=str(DATA / "preference" / "trl_conversational_demo.jsonl"), seq_len=64,
               global_batch=8, micro_batch_size=4, max_steps=1)
    tokenizer, eot, pairs, template, _ = rl_tasks.prepare_pairs(cfg, resolve_model(cfg.model), lambda _l: None)
    assert pairs.num_pairs == 48 and pairs.dropped == 0 and pairs.input_ids.shape == (96, 64)
    chat = D.ChatTokenizer(tokenizer, template, eos_token=eot, loss="last")
    chosen, rejected = _first_pair(str(DATA / "preference" / "trl_conversational_demo.jsonl"))
    for row, example in ((0, chosen), (1, rejected)):
        enc = chat.encode(example)
        n = len(enc.ids)
        assert pairs.input_ids[row, :n].tolist() == enc.ids.tolist()
        assert (pairs.input_ids[row, n:] == tokenizer.token_to_id(eot)).all()
        want = torch.full((64,), -100)
        want[:n][torch.as_tensor(enc.targets)] = torch.as_tensor(enc.ids)[torch.as_tensor(enc.targets)]
        assert torch.equal(pairs.labels[row], want)
    first = [int(torch.nonzero(pairs.labels[r] >= 0)[0]) for r in (0, 1)]
    assert first[0] == first[1] and torch.equal(pairs.input_ids[0, :first[0]], pairs.input_ids[1, :first[0]])
    assert pairs.labels[0, first[0]:].ne(pairs.labels[1, first[0]:]).any()  # the responses differ


def test_a_dpo_run_on_an_nvme_dir_in_use_is_refused_naming_it(tmp_path):
    """As megatrain train's other tasks (tests/test_nvme.py): one run at a time on an nvme_dir, the
    second refused before its model is built."""
    from megatrain.files import DirectoryLock, LockedError
    from megatrain.train.rundir import NVME_LOCK_FILE

    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    cfg = _cfg(tmp_path, task="dpo", data=str(DATA / "preference" / "trl_conversational_demo.jsonl"), seq_len=64,
               global_batch=8, micro_batch_size=4, max_steps=1, nvme_dir=str(nvme_dir))
    with DirectoryLock(nvme_dir / NVME_LOCK_FILE, "nvme_dir"), \
            pytest.raises(LockedError, match=f"nvme_dir {nvme_dir} is in use"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_sigterm_during_a_grpo_run_saves_a_checkpoint_and_the_same_command_resumes(tmp_path):
    """SIGTERM ends a DPO or GRPO run as it ends megatrain train's other tasks in their loop: the
    update under way finishes, a checkpoint is saved, the result says ``stopped_by``, the handlers
    and the output_dir and nvme_dir locks are let go, and the same command resumes the run. Here
    the reward sends the signal during step 1's rollouts."""
    import os
    import signal
    import sys

    from megatrain.files import DirectoryLock
    from megatrain.train.rundir import LOCK_FILE, NVME_LOCK_FILE

    (tmp_path / "term_reward_mod.py").write_text(
        "import os, signal\ncalls = []\ndef reward(prompts, completions, **kw):\n    calls.append(1)\n"
        "    if len(calls) == 1:\n        os.kill(os.getpid(), signal.SIGTERM)\n    return [0.0] * len(completions)\n")
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    kw = dict(task="grpo", data=str(DATA / "rl" / "arithmetic.jsonl"), seq_len=12, max_new_tokens=3, global_batch=8,
              micro_batch_size=8, group_size=4, max_steps=3, nvme_dir=str(nvme_dir), reward="term_reward_mod:reward")
    old = signal.getsignal(signal.SIGTERM)
    sys.path.insert(0, str(tmp_path))
    try:
        lines = []
        res = train(_cfg(tmp_path, **kw), echo=lines.append)
        assert res.stopped_by == "SIGTERM" and res.step == 1 and [r["step"] for r in _rows(tmp_path)] == [1]
        assert any(line.startswith("SIGTERM: stopped after step 1; saved") for line in lines)
        assert signal.getsignal(signal.SIGTERM) is old and os.getpid()  # the handler is put back
        for lock in (tmp_path / "run" / LOCK_FILE, nvme_dir / NVME_LOCK_FILE):
            with DirectoryLock(lock, str(lock)):  # free again: acquiring does not raise
                pass
        lines = []
        res = train(_cfg(tmp_path, **kw), echo=lines.append)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("term_reward_mod", None)
    assert any("resume: step 1 of" in line for line in lines)
    assert res.stopped_by is None and res.step == 3 and [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Resuming
# ---------------------------------------------------------------------------------------------

_TIMING = {"tokens_per_s", "mfu", "measured_step_s", "rollout_s", "host_rss_mib"}
_DPO = dict(task="dpo", data=str(DATA / "preference" / "trl_conversational_demo.jsonl"), seq_len=64, global_batch=8,
            micro_batch_size=4, max_steps=5, lr=3e-3)
_GRPO = dict(task="grpo", data=str(DATA / "rl" / "arithmetic.jsonl"), seq_len=12, max_new_tokens=3, global_batch=8,
             micro_batch_size=8, group_size=4, max_steps=6, lr=2e-3, kl_coef=0.05, grpo_updates=2)


def _final(run: Path):
    from safetensors.torch import load_file

    rows = [{k: v for k, v in json.loads(line).items() if k not in _TIMING}
            for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(run / "checkpoint" / "model.safetensors")


@pytest.mark.parametrize("kw, interval, crash_before", [
    (dict(_DPO, dpo_reference="precompute"), 2, 4),
    (dict(_DPO, dpo_reference="bfloat16"), 2, 4),
    # grpo_updates 2: the batches of rollouts are steps 1-2, 3-4, 5-6; the checkpoint of step 3 is
    # between the updates of the second, which the resumed run finishes on the same rollouts.
    (_GRPO, 3, 5),
], ids=["dpo-precompute", "dpo-bfloat16", "grpo-mid-batch"])
def test_a_crashed_rl_run_resumes_to_the_uninterrupted_runs_steps(tmp_path, monkeypatch, kw, interval, crash_before):
    """A DPO or GRPO run that crashed after a checkpoint, re-run with the same command, continues from
    the checkpoint (the seeded order, the reference, a pending batch of rollouts restored, the rows
    after it dropped) and ends where the run never interrupted ends: every metrics row (timings
    aside) and the final weights within 1e-5. Re-running the finished run does nothing. The data are
    cut to 12 pairs or 4 prompts, so that the resumed steps cross into the next epoch's order."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(Path(kw["data"]).read_text().splitlines(keepends=True)[:12 if kw["task"] == "dpo" else 4]))
    kw = {**kw, "data": str(data)}
    whole = train(_cfg(tmp_path / "whole", **kw))
    assert whole.step == kw["max_steps"]

    real = rl_tasks.RlRun.update

    def crashing(self, batch, extra):
        if self.step + 1 == crash_before:
            raise RuntimeError("killed")
        return real(self, batch, extra)

    monkeypatch.setattr(rl_tasks.RlRun, "update", crashing)
    cfg = _cfg(tmp_path, checkpoint_interval=interval, **kw)
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg)
    assert [r["step"] for r in _rows(tmp_path)] == list(range(1, crash_before))  # rows past the checkpoint too
    monkeypatch.setattr(rl_tasks.RlRun, "update", real)
    lines = []
    res = train(cfg, echo=lines.append)
    assert any(f"resume: step {interval} of" in line for line in lines), lines
    assert res.step == kw["max_steps"] and res.stopped_by is None
    (rows, weights), (want_rows, want) = _final(tmp_path / "run"), _final(tmp_path / "whole" / "run")
    assert [r["step"] for r in rows] == list(range(1, kw["max_steps"] + 1))
    for got, exp in zip(rows, want_rows):
        assert got.keys() == exp.keys()
        for k in exp:
            if isinstance(exp[k], float):
                assert got[k] == pytest.approx(exp[k], abs=1e-5), (got["step"], k)
            else:
                assert got[k] == exp[k], (got["step"], k)
    assert weights.keys() == want.keys()
    for k in want:
        assert torch.allclose(weights[k], want[k], rtol=0, atol=1e-5), k
    lines = []
    again = train(cfg, echo=lines.append)
    assert again.step == kw["max_steps"] and any("nothing to do" in line for line in lines)
    assert _final(tmp_path / "run")[0] == rows


def test_resuming_an_rl_run_with_other_position_settings_is_refused(tmp_path):
    """What fixes the order of the prompts, a batch's updates or the reference must be the
    checkpoint's (group_size, grpo_updates, a reference or none), and a checkpoint of the other task
    is not resumed as this one; each refused before the model is built, naming both values."""
    kw = dict(_GRPO, max_steps=2, checkpoint_interval=1)
    train(_cfg(tmp_path, **{**kw, "max_steps": 1}))  # a checkpoint at step 1 of 1: raise max_steps to go on
    for change, match in [({"group_size": 2}, "group_size=4 but this run has group_size=2"),
                          ({"grpo_updates": 1}, "grpo_updates=2 but this run has grpo_updates=1"),
                          ({"kl_coef": 0.0}, "reference='bfloat16' but this run has reference=None")]:
        with pytest.raises(ConfigError, match=match):
            train(_cfg(tmp_path, **{**kw, **change}))
    ckpt = tmp_path / "run" / "checkpoint"
    with pytest.raises(ConfigError, match="is a checkpoint of a task grpo run, not dpo; to start a new run from its "
                                          f"weights instead, give --init-from {re.escape(str(ckpt))}"):
        train(_cfg(tmp_path, **{**_DPO, "model": str(ckpt), "output_dir": str(tmp_path / "other")}))
    assert train(_cfg(tmp_path, **kw)).step == 2  # the same settings go on


# ---------------------------------------------------------------------------------------------
# Validation (val_data)
# ---------------------------------------------------------------------------------------------

def _training_fields(rows):
    return [{k: v for k, v in r.items() if k not in _TIMING and not k.startswith("val_")} for r in rows]


def test_dpo_validation_is_trls_eval_on_the_weights_and_leaves_training_alone(tmp_path):
    """val_data (here 6 pairs of the training data) is evaluated at every eval_interval and the last
    step: the rows there carry val_loss and TRL's eval rewards, the others none; the training rows
    are those of the run without val_data; the last val_loss and accuracy are DPO's on the saved
    model's eager log-probabilities of the validation pairs against the saved reference's."""
    from transformers import AutoModelForCausalLM

    from megatrain.checkpoint import load_extra_tensors
    from megatrain.train.model import resolve_model

    val = tmp_path / "val.jsonl"
    val.write_text("".join(Path(_DPO["data"]).read_text().splitlines(keepends=True)[:6]))
    kw = dict(_DPO, max_steps=4, eval_interval=2)
    plain = train(_cfg(tmp_path / "plain", **kw))
    res = train(_cfg(tmp_path, val_data=str(val), **kw))
    rows = _rows(tmp_path)
    assert plain.val_loss is None and res.val_loss == rows[-1]["val_loss"]
    assert _training_fields(rows) == _training_fields(_rows(tmp_path / "plain"))
    assert [r["step"] for r in rows if r.get("val_loss") is not None] == [2, 4]
    assert all(f"val_{k}" in rows[3] and f"val_{k}" not in rows[2] for k in rl_tasks.DPO_FIELDS)
    cfg = _cfg(tmp_path, val_data=str(val), **kw)
    *_, pairs = rl_tasks.prepare_pairs(cfg, resolve_model(cfg.model), lambda _l: None)
    assert pairs.num_pairs == 6
    ckpt = tmp_path / "run" / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    batch = {"input_ids": pairs.input_ids, "labels": pairs.labels}
    lp, mask = _eager_logps(model, batch), target_mask(pairs.labels)
    ref = load_extra_tensors(ckpt)["reference_logprobs_val"]
    loss = DPOLoss(cfg.dpo_beta)
    want = float(loss(lp, mask, {"ref_logprobs": ref}, {"pairs": 6}))
    assert rows[-1]["val_loss"] == pytest.approx(want, abs=1e-5)
    assert rows[-1]["val_rewards_accuracy"] == rl_tasks.dpo_metrics(loss, lp, mask, ref)["rewards_accuracy"]
    assert rows[-1]["val_loss"] < math.log(2)  # it trained on these pairs


def test_grpo_validation_rewards_its_prompts_and_leaves_training_alone(tmp_path):
    """GRPO's val_data: val_reward_mean and val_reward_std of group_size responses to each of its
    prompts at the eval steps, the training rows (rollouts, rewards, losses) those of the run
    without val_data (the validation's sampling leaves the training RNG alone); a val_data with no
    prompt that fits is refused naming it, and val_data for task lm is refused."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(Path(_GRPO["data"]).read_text().splitlines(keepends=True)[-5:]))
    kw = dict(_GRPO, max_steps=4, eval_interval=3)
    train(_cfg(tmp_path / "plain", **kw))
    lines = []
    train(_cfg(tmp_path, val_data=str(val), **kw), echo=lines.append)
    rows = _rows(tmp_path)
    assert _training_fields(rows) == _training_fields(_rows(tmp_path / "plain"))
    assert [r["step"] for r in rows if "val_reward_mean" in r] == [3, 4]
    assert all(0 <= r["val_reward_mean"] <= 1 and r["val_reward_std"] >= 0 for r in rows if "val_reward_mean" in r)
    assert any("validation: 5 prompts of" in line for line in lines)
    assert any(line.startswith("step 3:") and "validation reward" in line for line in lines)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "1+" * 40 + "1=", "answer": "41"}) + "\n")
    with pytest.raises(ConfigError, match=r"val_data .*long.jsonl.*none of its 1 prompts fits"):
        train(_cfg(tmp_path / "other", val_data=str(long), **kw))
    with pytest.raises(ConfigError, match="val_data is for task dpo and grpo"):
        _cfg(tmp_path, task="lm", val_data=str(val), max_steps=1)


def test_nonfinite_skip_drops_a_dpo_step_whose_loss_is_nan_and_goes_on(tmp_path, monkeypatch):
    """A DPO step whose loss is NaN (its batch's reference log-probabilities made to overflow): with
    nonfinite stop (the default) the run stops naming the step; with nonfinite skip (max_grad_norm
    set: the updates wait for the whole gradient) the step is not applied and counted, the run goes
    on, and a run of 2 steps whose second is skipped ends with the weights of the run of 1 step."""
    from safetensors.torch import load_file

    real = rl_tasks.RlRun.dpo_batch

    def poisoned(self):
        batch, mask, extra = real(self)
        if self.step == 1:  # the batch of step 2: each response's reference sum overflows, inf - inf
            batch["ref_logprobs"] = torch.where(mask, torch.tensor(3e38), torch.zeros(()))
        return batch, mask, extra

    kw = dict(_DPO, max_grad_norm=1.0)
    train(_cfg(tmp_path / "one", **{**kw, "max_steps": 1}))
    monkeypatch.setattr(rl_tasks.RlRun, "dpo_batch", poisoned)
    with pytest.raises(MegatrainError, match=r"step 2: the loss is not finite .*nonfinite: stop"):
        train(_cfg(tmp_path / "stop", **{**kw, "max_steps": 2}))
    lines = []
    res = train(_cfg(tmp_path, nonfinite="skip", **{**kw, "max_steps": 2}), echo=lines.append)
    rows = _rows(tmp_path)
    assert res.skipped_steps == 1 and res.step == 2 and [r["applied"] for r in rows] == [True, False]
    assert res.loss == rows[0]["loss"] and any("step 2: the loss is not finite" in line and "skipped" in line
                                               for line in lines)
    got = load_file(tmp_path / "run" / "checkpoint" / "model.safetensors")
    want = load_file(tmp_path / "one" / "run" / "checkpoint" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    lines = []
    again = train(_cfg(tmp_path, nonfinite="skip", **{**kw, "max_steps": 2}), echo=lines.append)
    assert again.skipped_steps == 1  # the finished run's count, from its checkpoint


# ---------------------------------------------------------------------------------------------
# Several reward functions (TRL's reward_funcs and reward_weights)
# ---------------------------------------------------------------------------------------------

def test_several_reward_functions_are_their_weighted_sum_each_checked_and_named():
    from megatrain.rl.rewards import RewardSum, load_rewards

    both = load_rewards("megatrain.rl.rewards:exact_match_reward, megatrain.rl.rewards:arithmetic_reward", [1.0, 0.5])
    completions, answer = ["7", "8", "x", " 7 apples"], ["7", "7", "7", "7"]
    got = score(both, ["3+4="] * 4, completions, {"answer": answer}, name="r")
    em, ar = exact_match_reward([], completions, answer), arithmetic_reward([], completions, answer)
    assert got.tolist() == pytest.approx([a + 0.5 * b for a, b in zip(em, ar)], abs=1e-7)
    assert both.last["megatrain.rl.rewards:exact_match_reward"].tolist() == em
    assert both.labels == {"megatrain.rl.rewards:exact_match_reward": "exact_match_reward",
                           "megatrain.rl.rewards:arithmetic_reward": "arithmetic_reward"}
    bad = RewardSum([("ok", exact_match_reward), ("m:bad", lambda p, c, **kw: [float("nan")] * len(c))])
    with pytest.raises(BatchError, match=r"^reward m:bad returned nan for completion 0"):
        score(bad, ["3+4="], ["7"], {"answer": ["7"]}, name="r")
    with pytest.raises(ConfigError, match=r"1 weights for 2 reward functions"):
        load_rewards("megatrain.rl.rewards:exact_match_reward,megatrain.rl.rewards:arithmetic_reward", [1.0])
    with pytest.raises(ConfigError, match="distinct"):
        load_rewards("megatrain.rl.rewards:exact_match_reward,megatrain.rl.rewards:exact_match_reward")
    same = RewardSum([("a.b:f", exact_match_reward), ("c:f", exact_match_reward)])
    assert same.labels == {"a.b:f": "a_b_f", "c:f": "c_f"}


def test_a_grpo_run_with_two_rewards_logs_each_and_trains_on_their_sum(tmp_path):
    """--reward f,g --reward-weights 1,0.5: each row's reward_mean is the weighted sum of the
    functions' means, each logged as reward_<function>_mean; weights of another count are refused
    when the settings are read."""
    spec = "megatrain.rl.rewards:exact_match_reward,megatrain.rl.rewards:arithmetic_reward"
    kw = dict(_GRPO, max_steps=2, reward=spec, reward_weights=[1.0, 0.5])
    train(_cfg(tmp_path, **kw))
    for r in _rows(tmp_path):
        want = r["reward_exact_match_reward_mean"] + 0.5 * r["reward_arithmetic_reward_mean"]
        assert r["reward_mean"] == pytest.approx(want, abs=1e-6)
        assert r["reward_arithmetic_reward_mean"] >= r["reward_exact_match_reward_mean"]  # 1 or 0.1 vs 1 or 0
    with pytest.raises(ConfigError, match=r"reward_weights \[1.0\]: 1 weights for 2 reward functions"):
        _cfg(tmp_path, **{**kw, "reward_weights": [1.0]})
    assert _cfg(tmp_path, **{**kw, "reward_weights": "1, 0.5"}).reward_weights == [1.0, 0.5]  # as a flag gives it
