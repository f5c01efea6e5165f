"""``megatrain train``: config and flags, the run's files, exact resume after a signal, and every
failure ending in one ``error:`` line with exit code 2.

A tiny Llama (2 layers, hidden 32, vocab 320) on 20 KB of this Python's standard library, seq_len
32. Runs of the CLI take a few seconds each; one module-scoped run serves several tests.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import megatrain.train as T
import megatrain.train.loop
import megatrain.runtime.measure
from megatrain.cli import _parser, main
from megatrain.errors import ConfigError, PlanError
from megatrain.trainer import Trainer

TINY = dict(model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

# The file sets max_steps 99 and run() sets 8: the flag must win.
CONFIG_YAML = """\
model: {model}
max_bytes: 20000
seq_len: 32
global_batch: 4
micro_batch_size: 2
lr: 5.0e-3
warmup_steps: 2
max_steps: 99
eval_interval: 4
eval_batches: 2
checkpoint_interval: 4
max_grad_norm: 1.0
"""
STEPS = 8
HANG_GUARD_S = 1800
"""Seconds a child process may take before the test calls it hung: not a speed check (a loaded
2-core machine runs these in minutes), only a bound on how long a hang blocks the suite."""


@pytest.fixture(autouse=True)
def _quick_matmul_probe(monkeypatch):
    monkeypatch.setattr(megatrain.runtime.measure, "MATMUL_SECONDS", 0.02)


def write_model(path: Path, **over) -> Path:
    path.write_text(json.dumps({**TINY, **over}))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("train")
    write_model(d / "config.json")
    (d / "run.yaml").write_text(CONFIG_YAML.format(model=d / "config.json"))
    return d


def run(setup: Path, out: Path, *extra: str) -> int:
    return main(["train", "--config", str(setup / "run.yaml"), "--output-dir", str(out),
                 "--max-steps", str(STEPS), *extra])


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def saved_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "megatrain_state" / "trainer_state.json").read_text())["extra_state"][T.STATE_KEY]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines()
             if line.strip() and not line.startswith(("train:", "[transformers]"))]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def first_run(setup, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("first") / "out"
    megatrain.runtime.measure.MATMUL_SECONDS, keep = 0.02, megatrain.runtime.measure.MATMUL_SECONDS
    try:
        assert run(setup, out, "--hardware", "H100_SXM") == 0
    finally:
        megatrain.runtime.measure.MATMUL_SECONDS = keep
    return out


# -- config ---------------------------------------------------------------------------------------

def test_every_config_field_is_a_flag_and_flags_override_the_file(setup, tmp_path):
    train_parser = _parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for a in train_parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {"--config"} | {"--" + f.replace("_", "-") for f in T.TrainConfig.model_fields}

    cfg = T.load_train_config(setup / "run.yaml", {"max_steps": "7", "max_grad_norm": "none", "nonfinite": "skip",
                                                   "output_dir": "o"})
    assert (cfg.max_steps, cfg.max_grad_norm, cfg.nonfinite, cfg.seq_len) == (7, None, "skip", 32)
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps({"model": "m", "output_dir": "o", "global_batch": 6, "micro_batch_size": 3}))
    assert T.load_train_config(as_json).micro_batches == 2

    bad = tmp_path / "bad.yaml"
    for text, match in [("model: m\noutput_dir: o\nsequence_len: 3\n", r"sequence_len.*Extra inputs"),
                        ("model: m\noutput_dir: o\nglobal_batch: 6\nmicro_batch_size: 4\n",
                         "global_batch=6 is not a multiple of micro_batch_size=4"),
                        ("model: m\noutput_dir: o\nwarmup_steps: 9\nmax_steps: 5\n", "warmup_steps=9 exceeds"),
                        ("output_dir: o\n", "model is required: give --model"),
                        ("- a list\n", "must hold a mapping"),
                        ("model: [unclosed\n", "not valid YAML")]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=match):
            T.load_train_config(bad)
    (tmp_path / "x.toml").write_text("model = 'm'\n")
    with pytest.raises(ConfigError, match=r"\.toml.*neither"):
        T.load_train_config(tmp_path / "x.toml")
    with pytest.raises(ConfigError, match="does not exist"):
        T.load_train_config(tmp_path / "absent.yaml")


def test_bad_flag_value_and_unknown_flag_exit_2(setup, tmp_path, capsys):
    assert run(setup, tmp_path / "o", "--seq-len", "many") == 2
    assert "seq_len='many'" in one_error_line(capsys.readouterr().err)
    assert run(setup, tmp_path / "o", "--nonfinite", "ignore") == 2
    assert "invalid choice: 'ignore'" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_learning_rate_warms_up_then_decays_by_cosine_to_the_floor():
    kw = dict(lr=1e-3, warmup_steps=4, max_steps=21, min_lr_ratio=0.1)
    lrs = [T.lr_at(s, **kw) for s in range(23)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    # Cosine from the peak at step 4 to the floor at the last step (20), halfway at step 12.
    assert lrs[4] == pytest.approx(1e-3) and lrs[12] == pytest.approx(0.55e-3) and lrs[20] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs[4:20], lrs[5:21])) and lrs[22] == pytest.approx(1e-4)
    assert T.lr_at(0, lr=1.0, warmup_steps=0, max_steps=1, min_lr_ratio=0.0) == 1.0


# -- a run ----------------------------------------------------------------------------------------

def test_run_writes_metrics_checkpoint_tokenizer_and_plot(first_run, setup):
    out = first_run
    r = rows(out)
    assert [x["step"] for x in r] == list(range(1, STEPS + 1))  # --max-steps beat the file's 99
    assert all(set(x) == set(T.METRIC_FIELDS) for x in r)
    assert all(x["applied"] for x in r)
    cfg = T.load_train_config(setup / "run.yaml", {"max_steps": STEPS, "output_dir": str(out)})
    for x in r:
        assert x["lr"] == T.lr_at(x["step"] - 1, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=STEPS,
                                  min_lr_ratio=cfg.min_lr_ratio)
        assert x["tokens_per_s"] == pytest.approx(4 * 32 / x["measured_step_s"])
        # windows of 32 tokens: every token is read; the targets are the labels after the shift but
        # those of documents' first tokens (-100: nothing predicts them across a document boundary)
        assert x["tokens"] == 4 * 32 and 0 < x["supervised_tokens"] <= 4 * 31
        assert 0 < x["mfu"] < 1 and 0 < x["grad_norm"] < 100 and x["host_rss_mib"] > 50
    # H100_SXM: a tiny model's step is bound by the issuing thread (about 2,000 dispatched ops at
    # launch_overhead_s = 8 us each, ~15 ms), far under 0.1 s and far over nothing.
    assert len({x["predicted_step_s"] for x in r}) == 1 and 0.001 < r[0]["predicted_step_s"] < 0.1
    assert [x["step"] for x in r if x["val_loss"] is not None] == [4, 8]
    # The loss falls on real text.
    assert sum(x["loss"] for x in r[-3:]) / 3 < r[0]["loss"] - 0.1
    assert r[-1]["val_loss"] < r[3]["val_loss"]

    ckpt = out / "checkpoint"
    state = saved_state(ckpt)
    assert state["step"] == state["batches_consumed"] == STEPS and state["seq_len"] == 32
    assert (ckpt / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()
    assert json.loads((out / "train_config.json").read_text())["max_steps"] == STEPS
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sigint_stops_after_the_step_saves_and_resume_is_exact(first_run, setup, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real_step = Trainer.step

    def step_then_sigint(self, batch):
        res = real_step(self, batch)
        if res.step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # a real signal, delivered while step 5 finishes
        return res

    monkeypatch.setattr(Trainer, "step", step_then_sigint)
    assert run(setup, out, "--hardware", "H100_SXM") == 0
    assert "SIGINT: stopped after step 5" in capsys.readouterr().out
    assert [x["step"] for x in rows(out)] == [1, 2, 3, 4, 5]
    assert saved_state(out / "checkpoint")["step"] == 5
    monkeypatch.setattr(Trainer, "step", real_step)

    # A row a crashed run wrote after its last checkpoint is dropped on resume.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**rows(out)[-1], "step": 6, "loss": -1.0}) + "\n")
    stamp = (out / "tokens" / "tokens.bin").stat().st_mtime_ns
    assert run(setup, out, "--hardware", "H100_SXM", "--model", str(out / "checkpoint")) == 0
    # The resumed run reads the same token store (not tokenised again) from batch 5 on.
    assert f"token store {out / 'tokens'} (reused)" in capsys.readouterr().out
    assert (out / "tokens" / "tokens.bin").stat().st_mtime_ns == stamp
    assert saved_state(out / "checkpoint")["data_fingerprint"] == saved_state(first_run / "checkpoint")[
        "data_fingerprint"]
    resumed, straight = rows(out), rows(first_run)
    assert [x["step"] for x in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(resumed, straight):
        assert (a["loss"], a["lr"], a["grad_norm"], a["val_loss"]) == (b["loss"], b["lr"], b["grad_norm"],
                                                                         b["val_loss"]), a["step"]
    w_resumed, w_straight = load_file(out / "checkpoint" / "model.safetensors"), \
        load_file(first_run / "checkpoint" / "model.safetensors")
    assert w_resumed.keys() == w_straight.keys()
    assert all(torch.equal(w_resumed[k], w_straight[k]) for k in w_straight)


def test_sigterm_to_a_real_process_saves_and_exits_0(setup, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megatrain.cli", "train", "--config", str(setup / "run.yaml"), "--output-dir",
           str(out), "--max-steps", "100000", "--checkpoint-interval", "0", "--eval-interval", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[1])
    try:
        # No deadline for the first steps (minutes on a loaded machine): a run that fails exits.
        while not ((out / "metrics.jsonl").is_file() and len(rows(out)) >= 2):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    last = rows(out)[-1]["step"]
    assert f"SIGTERM: stopped after step {last}" in stdout
    assert saved_state(out / "checkpoint")["step"] == last < 100000
    assert (out / "loss.png").is_file()


# -- non-finite steps -----------------------------------------------------------------------------

def _poison_step(at: int):
    """Trainer.step whose step ``at`` sees a NaN output layer, so its loss is NaN; the layer is
    restored after the step, so only that step is affected."""
    real_step = Trainer.step

    def step(self, batch):
        if self.step_count + 1 != at:
            return real_step(self, batch)
        self.flush()  # the previous step's deferred update belongs to the state we restore
        tile = self.host.master(len(self.graph.layers) - 1)
        keep = tile.clone()
        tile.fill_(math.nan)
        try:
            return real_step(self, batch)
        finally:
            tile.copy_(keep)

    return step


def test_nonfinite_step_is_skipped_or_stops_without_saving(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Trainer, "step", _poison_step(3))
    skip = tmp_path / "skip"
    assert run(setup, skip, "--nonfinite", "skip", "--max-steps", "4") == 0
    assert "warning: step 3: the loss is not finite" in capsys.readouterr().out
    r = rows(skip)
    assert [x["applied"] for x in r] == [True, True, False, True]
    assert r[2]["loss"] is None and all(x["loss"] is not None and math.isfinite(x["loss"]) for x in r[3:])
    assert saved_state(skip / "checkpoint")["skipped_steps"] == 1

    stop = tmp_path / "stop"
    assert run(setup, stop, "--nonfinite", "stop", "--max-steps", "5", "--checkpoint-interval", "2") == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: step 3: the loss is not finite") and "holds step 2" in line
    assert saved_state(stop / "checkpoint")["step"] == 2  # the state at step 3 was not saved
    assert [x["step"] for x in rows(stop)] == [1, 2, 3] and rows(stop)[2]["applied"] is False


# -- clean errors ---------------------------------------------------------------------------------

def test_corrupt_checkpoint_is_one_error_line_naming_the_file(first_run, setup, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_run / "checkpoint", ckpt)
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert run(setup, tmp_path / "o", "--model", str(ckpt)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model.safetensors" in line and "corrupt" in line


def test_weights_directory_loads_and_a_mismatched_one_names_file_and_tensor(first_run, setup, tmp_path, capsys):
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(first_run / "checkpoint" / name, weights / name)
    # A tiny learning rate: the validation loss after one step is the loaded model's.
    assert run(setup, tmp_path / "a", "--model", str(weights), "--max-steps", "1", "--warmup-steps", "0",
               "--lr", "1e-12") == 0
    assert "weights: loaded from" in capsys.readouterr().out
    assert rows(tmp_path / "a")[0]["val_loss"] == pytest.approx(rows(first_run)[-1]["val_loss"], abs=1e-5)

    cfg = json.loads((weights / "config.json").read_text())
    (weights / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    assert run(setup, tmp_path / "b", "--model", str(weights)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model.safetensors: tensor 'model.layers.0.mlp." in line and "[64, 32]" in line


def test_a_model_with_dropout_trains(setup, tmp_path, capsys):
    # GPT-2's defaults drop out embeddings, residuals and attention with p=0.1: once refused, now
    # replayed in each recompute (tests/test_dropout.py holds the exactness). Unsupported models
    # still name what is unsupported (the encoder-decoder case in the subprocess test below).
    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps(dict(model_type="gpt2", vocab_size=320, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)))
    assert run(setup, tmp_path / "o", "--model", str(model)) == 0
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) for r in rows if r.get("loss") is not None)


def test_host_memory_preflight_refuses_before_allocating(setup, tmp_path, capsys, monkeypatch):
    # 8.8e12 parameters: ~100 TB of host state, refused from the meta model's parameter count before
    # the CPU backend would build (or trace) it. What did not happen is checked, not how long it took.
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config.__func__

    def from_config(cls, *a, **kw):
        assert torch.empty(0).device.type == "meta", "the model was built in host memory"
        return real(cls, *a, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", classmethod(from_config))
    monkeypatch.setattr(megatrain, "plan_model", lambda *a, **k: pytest.fail("traced before the refusal"))
    huge = write_model(tmp_path / "huge.json", vocab_size=1 << 26, hidden_size=1 << 16, intermediate_size=1 << 17,
                       num_hidden_layers=1)
    assert run(setup, tmp_path / "o", "--model", str(huge)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: not enough host memory: this run needs about ")
    assert "GiB is available (MemAvailable" in line and "12 bytes of host state" in line
    assert "max_grad_norm: null" in line and not (tmp_path / "o").exists()


def test_a_run_traces_plans_and_simulates_once(setup, tmp_path, monkeypatch):
    """`megatrain train` plans once: the model it preflights is the one that runs, and the
    predicted step is the planned model's (not simulated again after compile)."""
    import megatrain.planner.front
    import megatrain.trainer

    calls = {"trace": 0, "simulate": 0, "lower": 0}

    def counting(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    for name in calls:  # the front door plans; the trainer lowers its eval schedule
        monkeypatch.setattr(megatrain.planner.front, name, counting(name, getattr(megatrain.planner.front, name)))
    monkeypatch.setattr(megatrain.trainer, "lower", counting("lower", megatrain.trainer.lower))
    assert main(_train_args(setup, tmp_path / "o", "--hardware", "H100_SXM", "--eval-interval", "0")) == 0
    # Clipping (max_grad_norm: 1.0): the first, carrying and update schedules, then one eval schedule.
    assert calls == {"trace": 1, "simulate": 1, "lower": 4}
    assert rows(tmp_path / "o")[0]["predicted_step_s"] > 0


def test_preflight_adds_data_and_shard_bytes_to_the_plan(tmp_path):
    import megatrain
    from megatrain.planner.cost import memory_breakdown
    from megatrain.ir.plan import default_plan
    from megatrain.planner.presets import build_meta_model, load_model_config

    planned = megatrain.plan_model(build_meta_model(load_model_config(write_model(tmp_path / "c.json"))),
                                   seq_len=16)
    graph = planned.graph
    host = memory_breakdown(graph, default_plan(graph, 1)).host_total
    assert planned.memory.host_total == host  # the preflight checks the plan that runs
    assert T.preflight_host_memory(planned, data_bytes=7, checkpoint_bytes=5, available=None) == host + 12
    assert T.preflight_host_memory(planned, data_bytes=7, available=(host + 7, "test")) == host + 7
    with pytest.raises(PlanError, match=r"needs about 0\.00 GiB .*data and tokenizer.* is available \(test\)"):
        T.preflight_host_memory(planned, data_bytes=7, available=(host + 6, "test"))
    have = T.available_host_memory()
    assert have is None or have[0] > 0
    # Two ranks of a node sharing one host copy: the weights and moments once, the rest twice.
    dp = dataclasses.replace(planned, plan=dataclasses.replace(planned.plan, data_parallel=2, optimizer_shards=2))
    shared = planned.memory.master_weights + planned.memory.adam_moments
    assert T.preflight_host_memory(dp, data_bytes=7, available=None) == shared + 2 * (host - shared + 7)
    with pytest.raises(PlanError, match="the node's 2 ranks share the weights and moments"):
        T.preflight_host_memory(dp, data_bytes=7, available=(host + 7, "test"))
    # Two ranks of a node with a copy each: both copies are in the node's memory.
    own = dataclasses.replace(planned, plan=dataclasses.replace(planned.plan, data_parallel=2))
    assert T.preflight_host_memory(own, data_bytes=7, available=None) == 2 * (host + 7)
    with pytest.raises(PlanError, match="the node's 2 ranks hold 2 copies of the weights and moments"):
        T.preflight_host_memory(own, data_bytes=7, available=(host + 7, "test"))
    # Moments on NVMe under data parallel: not in the shared copy; each rank's I/O buffers (its shard's
    # size, cost.nvme_buffers) count once per rank of the node.
    nvme_plan = dataclasses.replace(dp.plan, nvme_moments=frozenset(
        i for i, lay in enumerate(graph.layers) if lay.trainable_numel))
    mem = memory_breakdown(graph, nvme_plan)
    on_nvme = dataclasses.replace(dp, plan=nvme_plan, memory=mem)
    assert mem.adam_moments == 0 and 0 < mem.nvme_buffers < planned.memory.adam_moments
    assert T.preflight_host_memory(on_nvme, data_bytes=7, available=None) == (
        mem.master_weights + 2 * (mem.host_total - mem.master_weights + 7))
    # Two nodes of two ranks sharding the state: each node holds half the weights and moments (and
    # its gather tiles and scratch: cost.node_memory), the rest once per rank.
    from megatrain.planner.cost import node_memory

    sharded_plan = dataclasses.replace(dp.plan, data_parallel=4, nodes=2, host_state="shard")
    smem = memory_breakdown(graph, sharded_plan)
    sharded = dataclasses.replace(dp, plan=sharded_plan, memory=smem)
    node = node_memory(graph, sharded_plan, smem)
    assert node.persistent == -(-shared // 2) and node.gather_buffers > 0
    assert T.preflight_host_memory(sharded, data_bytes=7, available=None) == node.total + 2 * 7
    with pytest.raises(PlanError, match=r"share the weights and moments \(1/2 of them: host_state 'shard'\)"):
        T.preflight_host_memory(sharded, data_bytes=7, available=(node.total, "test"))


@pytest.mark.parametrize("fits", [True, False])
def test_host_state_auto_replicates_where_every_node_holds_a_copy_and_shards_otherwise(tmp_path, fits):
    """host_state 'auto' on several nodes is the front door's decision: 'replicate' where the
    caller's check of the replicated plan passes (megatrain train's preflight, agreed by an
    all-reduce), else 'shard', planned from the one trace; the choice and its reason are said."""
    from megatrain.planner import front
    from megatrain.planner.presets import build_meta_model, load_model_config

    seen = []
    topology = front.Topology(4, 2, host_state="auto", fits=lambda p: seen.append(p.plan.host_state) or fits)
    planned = front.plan(front.PlanRequest(build_meta_model(load_model_config(write_model(tmp_path / "c.json"))),
                                           seq_len=16, global_batch=4, topology=topology))
    assert seen == ["replicate"]  # the check saw the replicated plan
    want = "replicate" if fits else "shard"
    assert (planned.plan.host_state, planned.plan.data_parallel, planned.plan.nodes) == (want, 4, 2)
    assert planned.schedules.steady.plan == planned.plan
    assert planned.decisions[-1].startswith(f"host state: {want}: ")
    if not fits:
        assert "each of the 2 nodes holds 1/2" in planned.decisions[-1]


def test_megatrain_plan_config_writes_the_schedule_megatrain_train_runs(setup, tmp_path, capsys):
    """The issue's test of one planning front door: `megatrain plan --config RUN --out DIR` and
    `megatrain train --config RUN` write the same schedule.json byte for byte, on one GPU (with a
    hardware spec, whose prediction the plan reports) and with every layer's Adam moments on NVMe
    (NVME_READ/NVME_WRITE ops in it). Several ranks: test_distributed's torchrun test."""
    from megatrain.ir.schedule import OpKind, Schedule

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    for name, extra in (("one", "hardware: H100_SXM\n"), ("nvme", f"nvme_dir: {nvme}\n")):
        run_yaml = tmp_path / f"{name}.yaml"
        run_yaml.write_text(CONFIG_YAML.format(model=setup / "config.json") + extra)
        plan_out, run_out = tmp_path / f"plan_{name}", tmp_path / f"run_{name}"
        hw = ["--hardware", "H100_SXM"] if name == "nvme" else []
        assert main(["plan", "--config", str(run_yaml), *hw, "--out", str(plan_out)]) == 0
        report = capsys.readouterr().out
        assert main(["train", "--config", str(run_yaml), "--output-dir", str(run_out), "--max-steps", "1",
                     "--warmup-steps", "0", "--eval-interval", "0"]) == 0
        planned, ran = (plan_out / "schedule.json").read_bytes(), (run_out / T.SCHEDULE_FILE).read_bytes()
        assert planned == ran, name
        kinds = {op.kind for op in Schedule.from_json(ran.decode()).ops}
        assert (OpKind.NVME_READ in kinds) == (name == "nvme"), name
        assert "the default plan (megatrain train on the CPU backend)" in report
        if name == "one":
            assert "step time" in report and (plan_out / "trace.json").exists()  # predicted on H100_SXM
        else:
            assert "NVMe: Adam moments of 4 of 4 trainable layers" in report


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_cpu_build_bound_is_a_lower_bound_of_the_planned_preflight(tmp_path, clip):
    import megatrain
    from megatrain.planner.presets import build_meta_model, load_model_config
    from megatrain.train.preflight import BUILT_BYTES_PER_PARAMETER, preflight_cpu_build

    model = build_meta_model(load_model_config(write_model(tmp_path / "c.json")))
    n = sum(p.numel() for p in model.parameters())
    bound = preflight_cpu_build(model, clip=clip is not None, data_bytes=7, checkpoint_bytes=5, available=None)
    assert bound == n * (12 + (4 if clip else 0) + BUILT_BYTES_PER_PARAMETER) + 12
    planned = megatrain.plan_model(model, seq_len=16, max_grad_norm=clip)
    exact = T.preflight_host_memory(planned, data_bytes=7, checkpoint_bytes=5,
                                    built_bytes=n * BUILT_BYTES_PER_PARAMETER, available=None)
    assert bound <= exact  # what the bound refuses, the exact check would refuse too
    with pytest.raises(PlanError, match=r"the model built on the CPU .* is available \(test\)"):
        preflight_cpu_build(model, clip=clip is not None, data_bytes=7, available=(bound - 6, "test"))


def test_bad_data_tokenizer_and_output_dir_are_clean_errors(first_run, setup, tmp_path, capsys):
    assert run(setup, tmp_path / "o1", "--data", str(tmp_path / "missing")) == 2
    assert "error: data: corpus path" in one_error_line(capsys.readouterr().err)
    big = tmp_path / "big_tokenizer.json"
    shutil.copy(first_run / "tokenizer.json", big)
    assert run(setup, tmp_path / "o2", "--tokenizer", str(big), "--model",
               str(write_model(tmp_path / "small.json", vocab_size=300))) == 2
    assert "has 320 tokens but the model's vocab_size is 300" in one_error_line(capsys.readouterr().err)
    # The same command again: the finished run has nothing to do, which is not an error (a scheduler
    # that retries a finished job sees exit 0).
    assert run(setup, first_run) == 0
    assert "finished at step 8 (max_steps 8): nothing to do" in capsys.readouterr().out
    assert run(setup, first_run, "--seed", "3") == 2  # another run
    assert "holds another run (seed=0 there, 3 now)" in one_error_line(capsys.readouterr().err)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    assert run(setup, tmp_path / "foreign") == 2
    assert "holds no megatrain run of its own (it holds notes.txt)" in one_error_line(capsys.readouterr().err)


# -- failure paths in real processes ----------------------------------------------------------------
# Each was a traceback (exit 1) or a run that could not be re-run. The processes of one test run
# side by side: they are independent, and the suite runs on two cores.

REPO = Path(__file__).parents[1]


def _start(*args: str, limit_file_bytes: int | None = None) -> subprocess.Popen:
    def limit():  # a write past the limit fails with EFBIG, as a full disk fails with ENOSPC
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    return subprocess.Popen([sys.executable, "-m", "megatrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            preexec_fn=limit if limit_file_bytes else None)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return proc.returncode, out, err


def _train_args(setup: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(setup / "run.yaml"), "--output-dir", str(out), "--max-steps", "1",
            "--warmup-steps", "0", "--eval-batches", "1", *extra]


def test_bad_models_and_plan_out_are_one_error_line_in_a_real_process(setup, tmp_path):
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps(dict(model_type="t5", vocab_size=320, d_model=32, num_layers=2, num_heads=4)))
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(json.dumps({**TINY, "note": "caf\xe9"}, ensure_ascii=False).encode("latin-1"))
    (tmp_path / "a_file").write_text("")
    procs = {
        "t5": _start(*_train_args(setup, tmp_path / "o1", "--model", str(t5))),
        "latin1": _start(*_train_args(setup, tmp_path / "o2", "--model", str(latin1))),
        "plan --out a file": _start("plan", "--model", str(write_model(tmp_path / "c.json")), "--hardware",
                                    "H100_SXM", "--seq-len", "8", "--global-batch", "1", "--out",
                                    str(tmp_path / "a_file")),
    }
    res = {k: _finish(p) for k, p in procs.items()}
    expect = {"t5": (2, "model_type 't5' is an encoder-decoder model; megatrain trains causal decoder-only"),
              "latin1": (2, "latin1.json is not UTF-8 text"),
              "plan --out a file": (2, "a_file is a file; --out names a directory")}
    for k, (code, text) in expect.items():
        rc, out, err = res[k]
        line = one_error_line(err)
        assert rc == code and text in line, (k, rc, err)
        assert len(line) < 400, f"{k}: a {len(line)}-character message"
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_failed_save_is_an_error_line_and_the_same_command_runs_again(setup, tmp_path):
    # The first process may write files of at most 64 KB: the 0.16 MB model shard fails (a full disk
    # as far as the run can tell), before any checkpoint exists. The same command then starts over.
    # Beside it, Mixtral (a mixture of experts) trains a step on the CPU backend.
    mixtral = write_model(tmp_path / "mixtral.json", model_type="mixtral", num_local_experts=4,
                          num_experts_per_tok=2)
    out = tmp_path / "out"
    full = _start(*_train_args(setup, out), limit_file_bytes=64 * 1024)
    moe = _start(*_train_args(setup, tmp_path / "moe", "--model", str(mixtral)))
    rc, _, err = _finish(full)
    line = one_error_line(err)
    assert rc == 2 and "could not write the checkpoint" in line and "nothing was written" in line, err
    assert "the same command starts the run again" in line
    assert not (out / "checkpoint").exists() and (out / "train_config.json").is_file()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".megatrain.lock", ".tokens.lock"], \
        "a partial save was left behind"  # the lock files of output_dir and its token store stay
    again = _start(*_train_args(setup, out))
    rc, stdout, err = _finish(moe)
    assert rc == 0 and rows(tmp_path / "moe")[0]["applied"], err
    rc, stdout, err = _finish(again)
    assert rc == 0, err
    assert "stopped before its first complete checkpoint; starting it again" in stdout
    assert [r["step"] for r in rows(out)] == [1] and saved_state(out / "checkpoint")["step"] == 1


def test_models_that_are_not_causal_decoders_or_too_short_are_refused_first(setup, tmp_path, capsys):
    # BERT with its default dropout: the model kind is the error, not the dropout.
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps(dict(model_type="bert", vocab_size=320, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64)))
    assert run(setup, tmp_path / "o", "--model", str(bert)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model_type 'bert' is an encoder family with bidirectional attention" in line and "dropout" not in line
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps(dict(model_type="gpt2", vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                    embd_pdrop=0, resid_pdrop=0, attn_pdrop=0)))
    assert run(setup, tmp_path / "o", "--model", str(gpt2)) == 2  # seq_len 32
    assert "seq_len=32 exceeds" in (line := one_error_line(capsys.readouterr().err)) and "n_positions=16" in line
    llama = write_model(tmp_path / "llama.json", max_position_embeddings=16)
    assert run(setup, tmp_path / "o", "--model", str(llama)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "max_position_embeddings=16" in line and "rotary positions are computed" in line
    assert not (tmp_path / "o").exists()


def test_an_unwritable_output_dir_is_refused_before_the_data(setup, tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(megatrain.train.loop, "prepare_data", lambda *a: pytest.fail("data prepared before the check"))
    assert run(setup, tmp_path / "a_file" / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "a_file/out is not writable" in line and "--output-dir" in line


def test_a_stopped_run_without_checkpoint_reruns_and_a_partial_metrics_line_is_dropped(
        first_run, setup, tmp_path, monkeypatch, capsys):
    out = tmp_path / "stop"
    monkeypatch.setattr(Trainer, "step", _poison_step(2))
    assert run(setup, out, "--nonfinite", "stop", "--max-steps", "3") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "No checkpoint was saved: the same command starts the run again" in line
    monkeypatch.undo()
    monkeypatch.setattr(megatrain.runtime.measure, "MATMUL_SECONDS", 0.02)
    assert run(setup, out, "--nonfinite", "stop", "--max-steps", "3") == 0
    started_again = capsys.readouterr().out
    assert "starting it again" in started_again
    assert f"token store {out / 'tokens'} (reused)" in started_again  # the run's files go, its store stays
    assert [r["applied"] for r in rows(out)] == [True] * 3

    # A run killed while writing metrics.jsonl: the partial line is dropped when it resumes.
    resumed = tmp_path / "resumed"
    shutil.copytree(first_run, resumed)
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "lo')
    # Only the checkpoint, the output_dir and one more step: the run's other settings come from it.
    assert main(["train", "--model", str(resumed / "checkpoint"), "--output-dir", str(resumed), "--max-steps",
                 str(STEPS + 1)]) == 0
    assert f"warning: resuming with max_steps={STEPS + 1} (was {STEPS})" in capsys.readouterr().out
    assert [r["step"] for r in rows(resumed)] == list(range(1, STEPS + 2))


def test_the_checkpoint_names_the_tokenizers_special_tokens_and_generates(first_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    ckpt = first_run / "checkpoint"
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    gen = GenerationConfig.from_pretrained(ckpt)
    eot = tok.convert_ids_to_tokens(tok.eos_token_id)
    assert eot == "<|endoftext|>" and tok.eos_token_id == tok.convert_tokens_to_ids(eot)
    assert model.config.eos_token_id == gen.eos_token_id == tok.eos_token_id
    assert model.config.bos_token_id == gen.bos_token_id == tok.bos_token_id  # byte-level BPE: the same token
    ids = tok("def main():", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4) or out[0, -1] == tok.eos_token_id  # stops only at end-of-text
    assert tok.decode(out[0, :ids.shape[1]]) == "def main():"


# -- the token store ------------------------------------------------------------------------------

def test_the_data_line_reports_the_store_and_a_shared_data_cache_is_reused(setup, tmp_path, capsys):
    from megatrain.data import StoreWindows, open_token_store

    cache = tmp_path / "cache"
    assert main(_train_args(setup, tmp_path / "a", "--data-cache", str(cache))) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("data: "))
    # The start line names the device and why (the default, device: auto, on this machine's torch).
    assert out.splitlines()[0].startswith("device: cpu (auto: torch "), out.splitlines()[0]
    assert json.loads((tmp_path / "a" / "train_config.json").read_text())["device"] == "auto"
    with open_token_store(cache) as store:
        m = store.manifest
        # What max_bytes cut, and how to take it all, say so.
        assert (f"note: data: max_bytes=20,000 cut the corpus: training on its first {m.text_bytes / 1e6:.2f} MB of "
                f"text ({m.num_documents:,} documents) of {m.source_files:,} files holding {m.source_bytes / 1e6:.2f} "
                "MB on disk; max_bytes: null (--max-bytes none) trains on all of it") in out.splitlines()
        assert m.source_bytes > 10 * m.text_bytes
        windows = StoreWindows(store, 32, val_fraction=0.05, seed=0, document_attention=True)
        assert m.max_bytes == 20000 and 19000 < m.text_bytes <= 20000
        assert line.startswith(f"data: {m.num_documents:,} documents, {m.text_bytes / 1e6:.2f} MB of text -> "
                               f"{m.num_tokens:,} tokens in {windows.num_train_rows:,} training + "
                               f"{windows.num_val_rows:,} validation windows of 32; token store {cache} (built); "
                               "tokenizer: byte-level BPE trained here, vocab 320, end-of-text '<|endoftext|>'")
        fingerprint = windows.fingerprint()
    assert not (tmp_path / "a" / "tokens").exists()
    assert saved_state(tmp_path / "a" / "checkpoint")["data_fingerprint"] == fingerprint
    # Another run on the same data and tokenizer reads the same store; another budget rebuilds it.
    assert main(_train_args(setup, tmp_path / "b", "--data-cache", str(cache))) == 0
    assert f"token store {cache} (reused)" in capsys.readouterr().out
    assert main(_train_args(setup, tmp_path / "c", "--data-cache", str(cache), "--max-bytes", "30000")) == 0
    # (the BPE learns from the first max_bytes too, so it is the tokenizer that changed)
    assert f"token store {cache} (rebuilt (tokenizer changed))" in capsys.readouterr().out
    assert T.load_train_config(None, {"model": "m", "output_dir": "o"}).data_cache is None


def test_an_empty_directory_is_a_new_store_not_a_corrupt_one(tmp_path, caplog):
    """A fresh temporary directory (tempfile.mkdtemp, a mkdir'd data_cache) is built into without
    a "corrupt ... no manifest.json" warning; a directory with other files in it is still refused."""
    import logging
    import tempfile

    from megatrain.data import cached_token_store, train_bpe_tokenizer

    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 50)
    tok = train_bpe_tokenizer(["def f():\n    return 1\n" * 50], vocab_size=300)
    empty = Path(tempfile.mkdtemp(dir=tmp_path))
    with caplog.at_level(logging.WARNING):
        store = cached_token_store(tmp_path / "a.txt", tok, empty, progress=False)
    assert store.origin == "built" and not caplog.records, caplog.text
    store.close()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("")
    with caplog.at_level(logging.WARNING):
        store = cached_token_store(tmp_path / "a.txt", tok, tmp_path / "junk", progress=False)
    assert store.origin.startswith("rebuilt (corrupt") and "manifest.json" in caplog.text
    store.close()


def test_a_corrupted_store_is_rebuilt_and_the_resume_stays_exact(first_run, tmp_path, capsys):
    resumed = tmp_path / "resumed"
    shutil.copytree(first_run, resumed)
    tokens = resumed / "tokens" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[len(data) // 3] ^= 0x01
    tokens.write_bytes(bytes(data))
    assert main(["train", "--model", str(resumed / "checkpoint"), "--output-dir", str(resumed), "--max-steps",
                 str(STEPS + 1)]) == 0
    out = capsys.readouterr().out
    assert f"token store {resumed / 'tokens'} (rebuilt (corrupt: " in out and "tokens.bin does not match" in out
    # The rebuilt store holds the same tokens: the resume's data check (the windows' fingerprint) passed.
    assert [r["step"] for r in rows(resumed)] == list(range(1, STEPS + 2))
    assert tokens.read_bytes() == (first_run / "tokens" / "tokens.bin").read_bytes()


def _jsonl(path: Path, records: list[str]) -> Path:
    path.write_text("\n".join(records) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("given_tokenizer", [False, True], ids=["bpe-sample", "store-build"])
def test_bad_data_is_one_error_line_naming_the_file_and_line(first_run, setup, tmp_path, capsys, given_tokenizer):
    # Without a tokenizer the BPE's sample meets the bad record first; with one, the store's build.
    tok = ("--tokenizer", str(first_run / "tokenizer.json")) if given_tokenizer else ()
    good = json.dumps({"text": "def f(x):\n    return x\n" * 40})
    cases = [
        (_jsonl(tmp_path / "broken.jsonl", [good, good, '{"text": "no end']),
         ["broken.jsonl', line 3: not valid JSON"]),
        (_jsonl(tmp_path / "field.jsonl", [good, json.dumps({"body": "x"})]),
         ["field.jsonl', line 2: JSON value has no field 'text'"]),
        (_jsonl(tmp_path / "number.jsonl", [json.dumps({"text": 7})]),
         ["number.jsonl', line 1: field 'text' must be a string, got int"]),
        (_jsonl(tmp_path / "blank.jsonl", ["", json.dumps({"text": ""})]),
         ["no non-empty UTF-8 documents", "blank.jsonl"]),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n")
    cases.append((tmp_path / "empty", ["no non-empty UTF-8 documents found in", "empty"]))
    for i, (data, expected) in enumerate(cases):
        assert run(setup, tmp_path / f"o{i}", "--data", str(data), *tok) == 2, data
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith("error: data: ") and all(e in line for e in expected), line
        assert not (tmp_path / f"o{i}" / "checkpoint").exists()
    # The same command after the data are fixed: the failed run left at most its (unfinished) store.
    (tmp_path / "empty" / "a.txt").write_text("x = 1\n" * 2000)
    assert run(setup, tmp_path / f"o{len(cases) - 1}", "--data", str(tmp_path / "empty"), *tok,
               "--max-steps", "2") == 0


def test_too_little_text_for_a_batch_leaves_only_the_store_and_the_same_command_runs_again(
        first_run, setup, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("x = 1\n" * 20)
    out = tmp_path / "out"
    tok = ("--tokenizer", str(first_run / "tokenizer.json"))
    assert run(setup, out, "--data", str(corpus), *tok) == 2
    assert "corpus too small" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == [".tokens.lock", "tokens"]  # and the store's lock file
    corpus.write_text("x = 1\n" * 2000)
    assert run(setup, out, "--data", str(corpus), *tok, "--max-steps", "2") == 0
    assert f"token store {out / 'tokens'} (rebuilt (source changed))" in capsys.readouterr().out


def test_task_sft_trains_on_a_mixture_with_the_tokenizers_chat_template(first_run, setup, tmp_path, capsys):
    completions, chats = tmp_path / "pc.jsonl", tmp_path / "chats.json"
    completions.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "completion": f" return x + {i}"}) + "\n"
                                   for i in range(30)))
    chats.write_text(json.dumps([{"messages": [{"role": "user", "content": f"{i} + 1?"},
                                               {"role": "assistant", "content": str(i + 1)}]} for i in range(10)]))
    # A tokenizer whose tokenizer_config.json has a chat template (no generation markers: the
    # assistant's tokens are found by prefix differences); the checkpoint keeps it.
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(first_run / "tokenizer.json", tok / "tokenizer.json")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    out = tmp_path / "out"
    assert run(setup, out, "--task", "sft", "--data", f"{completions},{chats}:3", "--tokenizer",
               str(tok / "tokenizer.json"), "--max-steps", "2", "--val-fraction", "0.2") == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data: "))
    # weights 1:3 over the 32 training examples: 8 completions and 24 chats (each chat about 3 times)
    assert line.startswith(f"data: 40 SFT examples from {completions} (prompt_completion, 30; 8 a training "
                           f"epoch), {chats} (messages, 10; 24 a training epoch); 0 trimmed"), line
    assert "0 dropped (trim)" in line
    assert "packed rows" in line and f"chat template: {tok / 'tokenizer_config.json'}, assistant tokens by prefix " \
        "differences" in line
    assert f"SFT store {out / 'tokens'} (built)" in line
    assert [r["step"] for r in rows(out)] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows(out))
    assert all(r["examples_trimmed"] == r["examples_dropped"] == 0 for r in rows(out))
    saved = json.loads((out / "checkpoint" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == template
    # A bad record: one error line naming the file and the record.
    chats.write_text(json.dumps([{"messages": [{"role": "user", "content": "hi"}]}]))
    assert run(setup, tmp_path / "bad", "--task", "sft", "--data", str(chats)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"error: data: '{chats}', record 1: the chat has no assistant message" in line


def test_init_from_a_checkpoint_with_a_flipped_byte_is_refused(first_run, setup, tmp_path, capsys):
    """Issue 44, item 5: --init-from checks a megatrain checkpoint's files against its manifest,
    as a resume and from_pretrained do (a flipped byte, one weight -0.064 -> -65.1, used to train
    and exit 0)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_run / "checkpoint", ckpt)
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    assert run(setup, tmp_path / "out", "--init-from", str(ckpt)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{shard}: sha256 differs from the manifest's; the file is corrupt" in line


def test_init_from_starts_a_new_sft_run_from_a_pretrained_checkpoint(first_run, setup, tmp_path, capsys):
    """Pretrain (first_run: 8 steps, global_batch 4), then SFT from its checkpoint with another
    batch and schedule: a new run from step 0 with fresh AdamW state on the checkpoint's weights
    and tokenizer. Passing the checkpoint as --model instead is a resume, refused for the changed
    batch with a message that names --init-from."""
    ckpt = first_run / "checkpoint"
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n", "completion": f"    return x + {i}\n"}) + "\n"
                            for i in range(40)))  # 2 validation rows
    sft = ["--task", "sft", "--data", str(data), "--seq-len", "32", "--global-batch", "2", "--micro-batch-size", "2",
           "--warmup-steps", "0", "--eval-batches", "1", "--weight-decay", "0", "--sample-tokens", "0"]
    assert main(["train", "--model", str(ckpt), "--output-dir", str(tmp_path / "resumed"), *sft,
                 "--max-steps", "9"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "global_batch=4 but this run has global_batch=2" in line and f"--init-from {ckpt}" in line
    # lr 1e-9: two AdamW steps move a weight by about 2e-9 (Adam's step is lr x m/sqrt(v), at most
    # about lr), so the run ends on the checkpoint's weights up to that; a fresh initialisation would
    # differ by about initializer_range (0.02).
    out = tmp_path / "sft"
    assert main(["train", "--init-from", str(ckpt), "--output-dir", str(out), *sft, "--max-steps", "2",
                 "--lr", "1e-9"]) == 0
    text = capsys.readouterr().out
    assert f"weights: loaded from {ckpt} (init_from: a new run from step 0 with fresh AdamW state; not a resume)" in text
    assert f"tokenizer: {ckpt / 'tokenizer.json'}" in text
    assert [r["step"] for r in rows(out)] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows(out))
    state = saved_state(out / "checkpoint")
    assert (state["step"], state["global_batch"]) == (2, 2)
    trainer_state = json.loads((out / "checkpoint" / "megatrain_state" / "trainer_state.json").read_text())
    assert trainer_state["step_count"] == 2, "the optimizer's steps start again"
    pre, new = load_file(ckpt / "model.safetensors"), load_file(out / "checkpoint" / "model.safetensors")
    assert pre.keys() == new.keys()
    assert max((pre[k] - new[k]).abs().max().item() for k in pre) < 1e-7
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["model"] == saved["init_from"] == str(ckpt)
    # The same command again resumes the new run (its own checkpoint), not init_from.
    assert main(["train", "--init-from", str(ckpt), "--output-dir", str(out), *sft, "--max-steps", "3",
                 "--lr", "1e-9"]) == 0
    assert f"resume: step 2 of {out / 'checkpoint'}" in capsys.readouterr().out
    assert [r["step"] for r in rows(out)] == [1, 2, 3]


def test_a_gpu_hardware_spec_with_nvme_dir_trains_without_a_prediction(setup, tmp_path, capsys):
    """hardware: H100_SXM (no NVMe tier) with nvme_dir on the CPU backend: the run trains with the
    moments on NVMe and says why there is no predicted step (it used to stop with an error that
    told the user to use a preset, which it was)."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = tmp_path / "out"
    assert run(setup, out, "--hardware", "H100_SXM", "--nvme-dir", str(nvme), "--max-steps", "2") == 0
    text = capsys.readouterr().out
    assert "note: H100 SXM 80GB (preset) has no NVMe tier to time the plan's NVMe reads and writes" in text
    assert all(r["predicted_step_s"] is None and math.isfinite(r["loss"]) for r in rows(out))
    assert sorted(p.name for p in nvme.iterdir()) == [".megatrain-nvme.lock"] + [f"L{i}.moments.tile" for i in range(4)]


def test_a_small_preset_trains_from_scratch_on_the_cpu(tmp_path, capsys):
    """--model llama-30m: the preset's architecture, a byte-level BPE of its 8192-token vocabulary
    trained on the data, one step on the CPU backend."""
    out = tmp_path / "out"
    assert main(["train", "--model", "llama-30m", "--output-dir", str(out), "--max-bytes", "200000", "--seq-len", "32",
                 "--global-batch", "2", "--micro-batch-size", "2", "--max-steps", "1", "--warmup-steps", "0",
                 "--eval-batches", "1", "--sample-tokens", "2"]) == 0
    text = capsys.readouterr().out
    assert "model: LlamaForCausalLM, 29.37 M parameters" in text, text[:1500]
    # BPE learns at most the vocabulary's 8192 tokens (fewer from 200 KB of text).
    assert 257 < int(re.search(r"tokenizer: byte-level BPE trained here, vocab ([\d,]+)", text).group(1).replace(",", "")) <= 8192
    assert math.isfinite(rows(out)[0]["loss"]) and "sample (greedy): " in text


def test_the_preflight_counts_the_store_reader_not_the_corpus(setup, tmp_path):
    from megatrain.train.preflight import (BATCH_BYTES_PER_TOKEN, DATA_BYTES_PER_TEXT_BYTE, STORE_READER_BYTES,
                                           data_pipeline_bytes)

    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    small.write_text("x" * 1000)
    with open(big, "wb") as f:  # sparse: 8 GB on paper, nothing on disk
        f.truncate(8 << 30)
    reader = STORE_READER_BYTES + 4 * 32 * BATCH_BYTES_PER_TOKEN
    for data in (small, big):
        cfg = T.load_train_config(setup / "run.yaml", {"data": str(data), "max_bytes": "none", "output_dir": "o"})
        assert data_pipeline_bytes(cfg) == reader
        # A BPE's sample counts, up to the corpus's size.
        assert data_pipeline_bytes(cfg, 10_000_000) == reader + min(data.stat().st_size, 10_000_000) * \
            DATA_BYTES_PER_TEXT_BYTE
    with pytest.raises(ConfigError, match="data: corpus path"):
        data_pipeline_bytes(T.load_train_config(None, {"model": "m", "output_dir": "o",
                                                       "data": str(tmp_path / "none")}))


def test_config_paths_are_relative_to_the_file_and_binary_files_are_reported(tmp_path):
    from megatrain.data import load_documents

    sub = tmp_path / "conf"
    (sub / "corpus").mkdir(parents=True)
    (sub / "corpus" / "a.py").write_text("x = 1\n")
    (sub / "corpus" / "b.txt").write_bytes(b"\xff\xfe\x00binary")
    (sub / "c.json").write_text("{}")
    (sub / "run.yaml").write_text("model: c.json\ndata: corpus\noutput_dir: out\nhardware: H100_SXM\n")
    cfg = T.load_train_config(sub / "run.yaml")
    assert (cfg.model, cfg.data, cfg.output_dir) == (str(sub / "c.json"), str(sub / "corpus"), str(sub / "out"))
    assert cfg.hardware == "H100_SXM"  # names no file there: a preset
    skipped = []
    assert load_documents(cfg.data, skipped=skipped) == ["x = 1\n"] and skipped == [sub / "corpus" / "b.txt"]


@pytest.mark.parametrize("setting, gpus, device, line", [
    ("auto", 0, "cpu", "device: cpu (auto: torch {v} sees no CUDA GPU)"),
    ("auto", 2, "cuda", "device: cuda (auto: torch {v} sees 2 CUDA GPUs)"),
    ("cpu", 1, "cpu", "device: cpu, as set (device: cpu); torch {v} sees 1 CUDA GPU, which this run leaves idle: "
                      "--device auto or --device cuda trains on it"),
    ("cpu", 0, "cpu", "device: cpu, as set (torch {v} sees no CUDA GPU)"),
    ("cuda", 1, "cuda", "device: cuda, as set (torch {v} sees 1 CUDA GPU)"),
])
def test_device_auto_takes_the_gpu_torch_sees_and_the_start_line_says_why(setup, monkeypatch, setting, gpus, device,
                                                                          line):
    """``device: auto`` (the default) is CUDA where torch sees a CUDA device, else the CPU; a run on
    the CPU by choice beside a GPU says so (torch.cuda is stubbed: this machine has no GPU)."""
    import torch

    from megatrain.train.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cfg = T.load_train_config(setup / "run.yaml", {"output_dir": "x", **({} if setting == "auto" else
                                                                       {"device": setting})})
    assert T.TrainConfig.model_fields["device"].default == "auto" and cfg.device == setting
    resolved, said = resolve_device(cfg)
    assert resolved.device == device and said == line.format(v=torch.__version__)


def test_device_cuda_without_a_gpu_is_an_error_that_says_why(setup, monkeypatch):
    import torch

    from megatrain.train.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ConfigError, match=r"device: cuda, but torch .* is a build without CUDA; install a CUDA build"):
        resolve_device(T.load_train_config(setup / "run.yaml", {"output_dir": "x", "device": "cuda"}))
    # Planned, not run (megatrain plan --config, the plan megatrain train would make): the GPU's
    # plan on any machine, as the line says.
    cfg, line = resolve_device(T.load_train_config(setup / "run.yaml", {"output_dir": "x", "device": "cuda"}),
                               planning=True)
    assert cfg.device == "cuda" and line.startswith("device: cuda, as set (planned here, where torch")


def test_the_loss_plot_names_the_models_directory_not_its_file(tmp_path):
    """The plot's title: a preset's name, a config.json's directory, a run's checkpoint with its run
    (never "config.json" or "checkpoint" alone)."""
    from megatrain.train.model import model_label

    (tmp_path / "tiny-llama").mkdir()
    write_model(tmp_path / "tiny-llama" / "config.json")
    (tmp_path / "train_lm-1" / "checkpoint").mkdir(parents=True)

    def label(**kw) -> str:
        return model_label(T.TrainConfig(output_dir="x", **kw))

    assert label(model="llama-30m") == "llama-30m"
    assert label(model=str(tmp_path / "tiny-llama" / "config.json")) == "tiny-llama"
    assert label(model=str(tmp_path / "tiny-llama")) == "tiny-llama"
    assert label(model=str(tmp_path / "train_lm-1" / "checkpoint")) == "train_lm-1/checkpoint"
    assert label(init_from=str(tmp_path / "train_lm-1" / "checkpoint")) == "train_lm-1/checkpoint (init_from)"
