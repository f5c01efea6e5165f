"""bench/compare.py: the dry run end to end on the CPU, and the FLOP and token accounting by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "compare.py"


def _load_compare():
    spec = importlib.util.spec_from_file_location("bench_compare", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


compare = _load_compare()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_results")
    # No time limit: the dry run takes about 30 s idle and several times that on a loaded machine.
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--results-dir", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    return p, out


def test_dry_run_exits_zero_and_prints_the_table(dry_run):
    p, _ = dry_run
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "| system | params | tokens/s | TFLOPS | MFU |" in p.stdout
    for system in compare.SYSTEMS:
        assert f"| {system} |" in p.stdout
    assert "command: `python bench/compare.py --dry-run" in p.stdout
    assert "### Llama tiny:" in p.stdout and "TFLOPS as MegaTrain counts (6 N, padded tokens)" in p.stdout


def test_dry_run_writes_one_row_per_system(dry_run):
    _, out = dry_run
    files = sorted(out.glob("*-tiny.json"))
    assert len(files) == 1 and files[0].name.endswith("-cpu-dry-run-tiny.json"), files
    record = json.loads(files[0].read_text())
    rows = record["rows"]
    assert [r["system"] for r in rows] == list(compare.SYSTEMS)
    meta = record["meta"]
    assert meta["versions"]["torch"] and meta["versions"]["transformers"] and meta["versions"]["megatrain"]
    assert meta["peak_matmul"]["flops_per_s"] > 0 and "CPU" in meta["peak_matmul"]["what"]
    assert record["model"]["params"] == compare.param_count(compare.MODELS["tiny"])
    by = {r["system"]: r for r in rows}
    for system in ("megatrain", "torch"):
        r = by[system]
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu"]
        assert all(math.isfinite(x) for x in r["losses"]) and math.isfinite(r["final_loss"])
        assert r["peak_host_bytes"] > 0
        # 2 timed steps of 4 x 32 tokens, some of them padding (pad fraction 0.25 in a dry run).
        assert len(r["timed_tokens"]) == 2 and all(0 < t < 4 * 32 for t in r["timed_tokens"])
        assert r["timed_padded_tokens"] == [4 * 32] * 2  # MegaTrain's accounting counts the padding too
        assert r["tflops_6n_padded"] == pytest.approx(
            6 * compare.param_count(compare.MODELS["tiny"]) * 2 * 4 * 32 / sum(r["step_times_s"]) / 1e12)
    assert by["megatrain"]["timed_tokens"] == by["torch"]["timed_tokens"]  # the same data for all
    # megatrain ran the solver's plan for the spec (a preset in the dry run), at the run's micro-batches.
    # Both megatrain rows recorded their last timed step: its measured Timeline beside the same
    # schedule simulated, per op kind and by what ran beside each compute op, both written out.
    from megatrain.planner.timeline import Timeline

    for system in ("megatrain", "megatrain-own-plan"):
        r = by[system]
        assert r["stream_busy_measured"]["compute"] > 0 and r["megatrain_timeline_step_s"] > 0
        assert r["by_kind"]["FWD"]["measured_s"] > 0 and r["by_kind"]["BWD"]["predicted_s"] > 0
        assert {c["kind"] for c in r["by_context"]} >= {"FWD", "BWD"}
        saved = json.loads(Path(r["timelines_file"]).read_text())
        assert Path(r["timelines_file"]).parent == out and saved["measured"]["source"] == "measured"
        measured = Timeline.from_json(json.dumps(saved["measured"]))
        assert measured.step_time_s == r["megatrain_timeline_step_s"]
        assert sum(x.duration_s for x in measured.records if x.kind.value == "FWD") == \
            pytest.approx(r["by_kind"]["FWD"]["measured_s"])
    assert len(set(out.glob("*-timelines.json"))) == 2
    plan, settings = by["megatrain"]["megatrain_plan"], meta["settings"]
    assert plan["chosen_by"].startswith("solver (")
    assert plan["micro_batches"] * settings["micro_batch"] == settings["global_batch"]
    # The plan's memory beside the measured peaks (the dry run's plan is for the CPU: no GPU reserve).
    assert 0 < plan["planned_pinned_bytes"] <= plan["planned_host_bytes"] < by["megatrain"]["peak_host_bytes"]
    assert plan["planned_gpu_peak_bytes"] > 0
    # megatrain-own-plan: the solver chose the micro-batch size and count for the same global batch,
    # and ran them: the same token-weighted loss on every step as the benchmark's split (FP32 in a dry
    # run; the exactness bound of a micro-batch split, 1e-5).
    own = by["megatrain-own-plan"]
    assert own["status"] == "ok", own
    mp = own["megatrain_plan"]
    assert mp["chosen_by"].startswith("solver (") and "micro-batch size and count" in mp["chosen_by"]
    assert mp["micro_batch_size"] * mp["micro_batches"] == settings["global_batch"]
    assert f"micro-batch {mp['micro_batch_size']} x {mp['micro_batches']}" in own["note"]
    assert own["timed_tokens"] == by["megatrain"]["timed_tokens"]
    assert len(own["losses"]) == len(by["megatrain"]["losses"])
    assert all(abs(a - b) <= 1e-5 for a, b in zip(own["losses"], by["megatrain"]["losses"])), \
        (own["losses"], by["megatrain"]["losses"])
    for r in rows:
        assert r["status"] in ("ok", "skipped"), r
        if r["status"] == "skipped":
            assert r["reason"].strip(), r
    assert by["deepspeed"]["status"] == "skipped" and "CUDA" in by["deepspeed"]["reason"]
    assert by["fsdp2"]["status"] == "ok" and "no offload" in by["fsdp2"]["note"]


def test_model_flops_per_token_by_hand():
    # vocab 10, hidden 8, FFN 16, 2 layers, 2 heads of dim 4, 1 KV head (k and v are 8 x 4).
    cfg = compare.ModelConfig("hand", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                              num_heads=2, num_kv_heads=1)
    per_layer = (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8) + 3 * 8 * 16 + 2 * 8  # q k v o, gate up down, 2 norms
    assert per_layer == 592
    n_total = 2 * 592 + 8 + 10 * 8 + 10 * 8  # layers, final norm, embedding, untied lm_head
    assert compare.param_count(cfg) == n_total == 1352
    n = n_total - 10 * 8  # the input embedding is a gather, not a matmul
    assert compare.matmul_param_count(cfg) == n == 1272
    seq = 5
    attention = 12 * 2 * (2 * 4) * seq  # 12 L H Q T
    assert compare.model_flops_per_token(cfg, seq) == 6 * n + attention == 8592

    args = Namespace(seq_len=seq, peak_flops=1e6)
    row = {"step_times_s": [1.0, 3.0], "timed_tokens": [100, 50], "timed_padded_tokens": [120, 120],
           "losses": [2.0, 1.5, 1.0]}
    compare.fill_accounting(row, cfg, args)
    assert row["tokens_per_s"] == 150 / 4
    assert row["tflops"] == pytest.approx((6 * n * 150 + attention * 150) / 4 / 1e12, rel=1e-15)
    assert row["mfu"] == pytest.approx(row["tflops"] * 1e12 / 1e6)
    # MegaTrain's accounting: every parameter, every token of the batch (padding too), no attention term.
    assert row["tflops_6n_padded"] == pytest.approx(6 * n_total * 240 / 4 / 1e12, rel=1e-15)
    assert row["step_time_s"] == 2.0 and row["final_loss"] == 1.0


def test_param_count_matches_the_hugging_face_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from megatrain.planner.presets import MODEL_PRESETS, dense_decoder_param_count

    for name in ("tiny", "1b", "7b", "qwen2.5-7b", "llama-3-8b"):
        cfg = compare.MODELS[name]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg.hf_config(128))
        assert sum(p.numel() for p in model.parameters()) == compare.param_count(cfg), name
        if name in MODEL_PRESETS:  # the released model's shape, as megatrain plan --model plans it
            assert compare.param_count(cfg) == dense_decoder_param_count(MODEL_PRESETS[name]), name
    assert type(model).__name__ == "LlamaForCausalLM"
    assert compare.param_count(compare.MODELS["7b"]) == 6_738_415_616  # Llama-2-7B
    assert compare.param_count(compare.MODELS["qwen2.5-7b"]) == 7_615_616_512  # Qwen2.5-7B: its QKV biases
    assert compare.MODELS["qwen2.5-7b"].family == "qwen2"


def test_tokens_count_excludes_padding():
    b = compare.make_batch(8, 16, vocab=50, seed=3, pad_fraction=0.25)
    pad = (b["labels"] == -100)
    assert pad.any() and not pad[:, 0].any()
    assert compare.count_tokens(b) == 8 * 16 - int(pad.sum())
    assert (b["input_ids"][pad] == 0).all()
    again = compare.make_batch(8, 16, vocab=50, seed=3, pad_fraction=0.25)
    assert all((again[k] == b[k]).all() for k in b)  # seeded: every system sees the same tokens
    assert compare.count_tokens(compare.make_batch(2, 16, 50, seed=0, pad_fraction=0.0)) == 32


def test_deepspeed_config_is_zero3_with_both_offloads():
    cfg = compare.MODELS["1b"]
    args = Namespace(global_batch=16, micro_batch=2, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    c = compare.deepspeed_config(cfg, args)
    z = c["zero_optimization"]
    assert z["stage"] == 3 and z["overlap_comm"] and z["contiguous_gradients"]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True} == z["offload_optimizer"]
    assert z["reduce_bucket_size"] == 2048 ** 2 and z["stage3_param_persistence_threshold"] == 20480
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] == 16
    assert c["bf16"]["enabled"] and c["optimizer"]["params"]["betas"] == [0.9, 0.95]


def test_a_dry_run_refuses_a_size_a_gpu_run_would_not_know(capsys, tmp_path):
    # gpu_session.sh's dry run passes the GPU run's --sizes, so a misspelt size fails here, not on the GPU.
    assert compare.main(["--dry-run", "--sizes", "qwen2.5-7b,llama-3-8B", "--results-dir", str(tmp_path)]) == 2
    assert "unknown size(s) ['llama-3-8B']" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_written_gpu_session_commands_name_sizes_compare_knows():
    # The later steps' commands in bench/README.md and gpu_session.sh run on a GPU only; a size they
    # name that compare.py does not know would cost a session's device minutes to find.
    import re

    for path in (ROOT / "bench" / "README.md", ROOT / "bench" / "gpu_session.sh"):
        named = re.findall(r"(?:GPU_SESSION_COMPARE_SIZES=|_SIZES=|--sizes )([\w.,-]+)", path.read_text())
        sizes = {s for group in named for s in group.split(",")}
        assert {"3b", "qwen2.5-7b", "llama-3-8b"} <= sizes, (path, sizes)
        assert sizes <= set(compare.MODELS), (path, sizes - set(compare.MODELS))
