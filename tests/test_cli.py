"""Tests for ``megatrain plan``: the table, the three files, and the exit codes."""

from __future__ import annotations

import json
import math
import re

import pytest

from megatrain.cli import main
from megatrain.errors import ConfigError
from megatrain.ir.hardware import H100_SXM, MiB
from megatrain.planner.presets import MODEL_PRESETS, dense_decoder_param_count, load_model_config
from megatrain.ir.schedule import Schedule


def write_config(path, vocab=96, hidden=32, layers=2, tie=False):
    cfg = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, tie_word_embeddings=tie)
    path.write_text(json.dumps(cfg))
    return path


def test_plan_prints_the_table_writes_three_files_and_exits_0(tmp_path, capsys):
    cfg = write_config(tmp_path / "config.json")
    out = tmp_path / "out"
    rc = main(["plan", "--model", str(cfg), "--hardware", "H100_SXM", "--seq-len", "16", "--global-batch", "4",
               "--solver", "enumerate", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "fits: yes" in text
    for row in ("FP32 master weights", "Adam moments", "gradient ring", "staging ring", "pinned activations",
                "weight slots", "gradient slots", "buffers", "activations peak", "working peak", "reserve",
                "micro-batch size", "prefetch distance", "resident layers", "step time", "tokens/s", "MFU",
                "bottleneck", "compute busy", "h2d busy", "d2h busy", "host busy"):
        assert row in text, row
    assert "(GiB)" in text and "H100 SXM 80GB" in text
    assert "3 keep / 0 offload / 0 recompute" in text, "an H100 keeps a tiny model's 3 checkpoints"
    # The solver's micro-batches, and what bounds the simulated step: a tiny model's kernels take less
    # time than their launches, so its compute ops run while they are still being issued.
    m = re.search(r"micro-batches: (\d+) of (\d+) sequences? \(the solver's size\); the simulated step is "
                  r"issue-bound: its compute ops ran ([\d.e+-]+) s of the ([\d.e+-]+) s step while still being "
                  r"issued, ([\d.e+-]+) s with their work all queued", text)
    assert m, text
    assert int(m[1]) * int(m[2]) == 4 and float(m[5]) < float(m[3]) <= float(m[4])
    schedule = Schedule.load(out / "schedule.json")
    assert schedule.n_layers == 4 and schedule.plan.compute_dtype == "bfloat16"
    assert schedule.plan.micro_batches * int(text.split("micro-batch size")[1].split()[0]) == 4
    trace = json.loads((out / "trace.json").read_text())
    assert {e["ph"] for e in trace["traceEvents"]} >= {"X", "M", "C"}
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(schedule.ops)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_exits_2_with_the_minimum_memory_when_nothing_fits(tmp_path, capsys):
    # A 4096 x 64 embedding is a 256K-element layer: its BF16 weights and FP32 gradients alone
    # take 1.5 MiB, more than the 1 MiB GPU of this spec (with no reserve).
    cfg = write_config(tmp_path / "config.json", vocab=4096, hidden=64)
    spec = H100_SXM.model_copy(update={"name": "tiny GPU", "gpu_memory_bytes": 1 * MiB, "gpu_reserve_bytes": 0})
    spec_path = tmp_path / "tiny.json"
    spec.save(spec_path)
    rc = main(["plan", "--model", str(cfg), "--hardware", str(spec_path), "--seq-len", "16",
               "--global-batch", "2", "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert rc == 3, text
    assert "fits: NO" in text and "no plan fits" in text
    assert "The least GPU memory any plan needs is " in text and not re.search(r"\d{5,} bytes", text)
    assert "(GPU 1.00 MiB, host 2.00 TiB)" in text.splitlines()[0], "the header names the spec's sizes"
    assert "obstacle is layer 'prologue'" in text or "obstacle is layer 'epilogue'" in text
    assert not (tmp_path / "out").exists()


def test_plan_keeps_the_derived_gpu_reserve(tmp_path, capsys):
    """The GPU reserve is derived (cost.gpu_reserve: context, two cuBLAS workspaces on the compute
    stream, allocator rounding, per-stream pools), printed with its parts, and kept: the peak the
    plan fits in counts it, at the least GPU memory any plan needs too; a measured reserve in the
    spec replaces the derived one."""
    from megatrain.planner import cost

    cfg = write_config(tmp_path / "config.json")

    def plan(**spec) -> tuple[int, str]:
        path = tmp_path / "spec.json"
        H100_SXM.model_copy(update=spec).save(path)
        rc = main(["plan", "--model", str(cfg), "--hardware", str(path), "--seq-len", "16", "--global-batch", "4",
                   "--solver", "enumerate"])
        return rc, capsys.readouterr().out

    rc, text = plan(gpu_memory_bytes=1 * MiB)
    assert rc == 3
    value, unit = re.search(r"least GPU memory any plan needs is ([\d.]+) (MiB|GiB)", text).groups()
    least = math.ceil((float(value) + 0.005) * (MiB if unit == "MiB" else 1 << 30))  # (rounded to 2 decimals)
    rc, text = plan(gpu_memory_bytes=least)
    assert rc == 0, text
    row = next(line for line in text.splitlines() if line.strip().startswith("reserve"))
    assert "context 1.00 GiB + cuBLAS workspaces 66.00 MiB + allocator rounding" in row, row
    reserve = float(row.split()[1])
    assert reserve > (1024 + 66) / 1024, "the reserve holds the context and workspaces at least"
    peak = next(line for line in text.splitlines() if line.strip().startswith("peak")).split()
    assert reserve <= float(peak[1]) <= float(peak[3]), "the peak counts the reserve and fits"
    rc, text = plan(gpu_reserve_bytes=3 * cost.ROUND_LARGE_BYTES)
    row = next(line for line in text.splitlines() if line.strip().startswith("reserve"))
    assert rc == 0 and row.split()[1] == "0.01" and "measured (HardwareSpec.gpu_reserve_bytes)" in row, row


def test_plan_exits_2_with_one_error_line_on_bad_input(tmp_path, capsys):
    def error_line() -> str:
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        return err

    assert main(["plan", "--model", "no-such-model", "--hardware", "H100_SXM", "--seq-len", "8",
                 "--global-batch", "1"]) == 2
    assert "neither a preset" in error_line()
    cfg = write_config(tmp_path / "config.json")
    assert main(["plan", "--model", str(cfg), "--hardware", "TPU", "--seq-len", "8", "--global-batch", "1"]) == 2
    assert "no hardware preset named 'TPU'" in error_line()
    assert main(["plan", "--model", str(cfg)]) == 2
    assert "required" in error_line()
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps(dict(model_type="bert", vocab_size=96, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, intermediate_size=64)))
    assert main(["plan", "--model", str(bert), "--hardware", "H100_SXM", "--seq-len", "8", "--global-batch", "1"]) == 2
    assert "model_type 'bert' is an encoder family" in error_line()
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps(dict(model_type="no-such-type")))
    assert main(["plan", "--model", str(unknown), "--hardware", "H100_SXM", "--seq-len", "8",
                 "--global-batch", "1"]) == 2
    line = error_line()
    assert "cannot build a config of model_type 'no-such-type'" in line and len(line) < 400, line


def test_version(capsys):
    import megatrain

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"megatrain {megatrain.__version__}"


def test_load_model_config_keeps_tied_embeddings_and_rejects_bad_files(tmp_path):
    cfg = load_model_config(write_config(tmp_path / "config.json", tie=True))
    assert cfg.tie_word_embeddings is True and cfg.num_hidden_layers == 2
    assert load_model_config("llama-3-70b").num_hidden_layers == 80
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path / "bad.json")
    (tmp_path / "untyped.json").write_text("{}")
    with pytest.raises(ConfigError, match="model_type"):
        load_model_config(tmp_path / "untyped.json")


def test_every_preset_loads_and_counts_like_its_published_size():
    # llama-30m is not a released model: its size is the arithmetic in presets.py's docstring.
    published = {"llama-30m": 29.37e6, "smollm2-135m": 134.5e6, "smollm2-360m": 361.8e6, "qwen2.5-0.5b": 494.0e6,
                 "llama-3.2-1b": 1.236e9, "llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "qwen2.5-7b": 7.61e9,
                 "qwen2.5-14b": 14.77e9, "llama-3-70b": 70.55e9, "dense-120b": 121.5e9}
    assert set(published) == set(MODEL_PRESETS)
    for name, size in published.items():
        assert dense_decoder_param_count(load_model_config(name)) == pytest.approx(size, rel=2e-3), name


def test_the_small_presets_build_with_their_counted_parameters_and_are_listed_in_help(capsys):
    from megatrain.planner.presets import SMALL_PRESETS, build_meta_model

    for name in SMALL_PRESETS:
        config = load_model_config(name)
        model = build_meta_model(config)
        assert sum(p.numel() for p in model.parameters()) == dense_decoder_param_count(config), name
        assert dense_decoder_param_count(config) < 1.5e9 and config.tie_word_embeddings, name
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(SMALL_PRESETS) + " (train on a CPU); llama-2-7b" in text


def test_megatrain_help_imports_neither_torch_nor_transformers():
    """`megatrain --help` (and each command's) parses and prints with pydantic alone: torch and
    transformers load when a command runs."""
    import subprocess
    import sys

    code = ("import sys\nfrom megatrain.cli import main\n"
            "codes = [main(argv) for argv in (['--help'], ['plan', '--help'], ['train', '--help'])]\n"
            "print(codes, sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "[0, 0, 0] []", p.stdout[-500:]


def test_train_help_states_each_default_once(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    flags = re.split(r"\n  (?=--)", text.split("options:")[1])[1:]
    assert len(flags) > 30
    for flag in flags:
        assert flag.count("(default") <= 1 and "none for null" not in flag, flag
    assert "'none' on the command line" in " ".join(text.split())


def test_plan_prints_progress_on_stderr_and_the_host_table_counts_what_moved_to_nvme(tmp_path, capsys):
    """300 KiB of host memory fits this model only with state on NVMe: the host table subtracts it,
    so its total is what stays in RAM (below 100%) and equals the NVMe section's host total."""
    cfg = write_config(tmp_path / "config.json")
    assert main(["plan", "--model", str(cfg), "--hardware", "H100_SXM", "--seq-len", "16", "--global-batch", "4",
                 "--host-memory", "300KiB", "--nvme", "4xgen4"]) == 0
    out = capsys.readouterr()
    assert re.match(r"megatrain plan: tracing .*config.json \(2 layers\) on the meta device at seq_len 16 \.\.\.\n"
                    r"megatrain plan: traced 4 layers in [\d.]+ s; solving \(milp, then NVMe placement and "
                    r"read-ahead\) \.\.\.\n$", out.err), out.err
    host = out.out.split("\nhost memory (GiB)\n")[1].split("\n\n")[0]
    assert "moved to NVMe" in host and "NVMe I/O buffers" in host
    pct = float(re.search(r"  total .* \(([\d.]+)%\)", host).group(1))
    nvme_total = re.search(r"host total +([\d.]+) KiB +of 300.00 KiB", out.out)
    assert pct < 100 and pct == pytest.approx(100 * float(nvme_total.group(1)) / 300, abs=0.06), host


def test_plan_in_float32_on_a_one_layer_model(tmp_path, capsys):
    cfg = write_config(tmp_path / "config.json", layers=1)
    out = tmp_path / "o"
    assert main(["plan", "--model", str(cfg), "--hardware", "GH200", "--seq-len", "8", "--global-batch", "2",
                 "--compute-dtype", "float32", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "unused with FP32 compute" in text and "float32 compute" in text
    assert Schedule.load(out / "schedule.json").plan.compute_dtype == "float32"
    trace = json.loads((out / "trace.json").read_text())
    assert trace["otherData"]["source"] == "simulated" and trace["otherData"]["step_time_s"] > 0


def test_plan_with_clipped_gradients_defers_the_optimizer(tmp_path, capsys):
    cfg = write_config(tmp_path / "config.json")
    out = tmp_path / "out"
    rc = main(["plan", "--model", str(cfg), "--hardware", "H100_SXM", "--seq-len", "16", "--global-batch", "2",
               "--clip-gradients", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "next forward" in text
    schedule = Schedule.load(out / "schedule.json")
    assert schedule.carries_updates and schedule.plan.grad_ring == schedule.n_layers


def test_plan_counts_the_chosen_optimizers_state(tmp_path, capsys):
    """--optimizer lion plans Lion's one moment: its schedule names the optimizer and the report's
    moments row holds half of AdamW's bytes (megatrain.optim's state rows: 1 against 2)."""
    cfg = write_config(tmp_path / "config.json")
    rows = {}
    for name in ("adamw", "lion"):
        out = tmp_path / name
        rc = main(["plan", "--model", str(cfg), "--hardware", "H100_SXM", "--seq-len", "16", "--global-batch", "2",
                   "--optimizer", name, "--out", str(out)])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert Schedule.load(out / "schedule.json").plan.optimizer_name == name
        rows[name] = next(line for line in text.splitlines() if " moments (FP32 x" in line)
    assert "Adam moments (FP32 x2)" in rows["adamw"] and "Lion moments (FP32 x1)" in rows["lion"], rows
    assert main(["plan", "--config", str(cfg), "--optimizer", "lion"]) == 2  # the run's file says which
    assert "--optimizer" in capsys.readouterr().err


def _readme_block(heading: str, lang: str) -> str:
    from conftest import manual_section

    section = manual_section(heading)
    start = section.index(f"```{lang}\n") + len(f"```{lang}\n")
    return section[start:section.index("```\n", start)]


def test_readme_topology_command_prints_what_the_readme_says(capsys):
    """docs/data-parallel.md's "Planning for several GPUs and nodes" command, run as written: every line of its
    printed block appears in the output."""
    import shlex

    heading = "## Planning for several GPUs and nodes"
    argv = shlex.split(_readme_block(heading, "bash").strip())
    assert argv[:2] == ["megatrain", "plan"]
    assert main(argv[1:]) == 0
    text = capsys.readouterr().out
    for line in _readme_block(heading, "text").splitlines():
        assert line in text.splitlines(), line
    assert "host state               shard  shard: replicating does not fit" in text
    # One rank's table counts the whole state, which no node holds: no percentage of a node there.
    assert "the whole state; a node holds 1/2 of the masters and moments" in text


def test_plan_for_gpus_and_nodes(tmp_path, capsys):
    cfg = write_config(tmp_path / "config.json")
    base = ["plan", "--model", str(cfg), "--hardware", "H100_SXM", "--seq-len", "16", "--global-batch", "4"]

    def rows(text: str, section: str) -> dict[str, str]:
        block = text.split("\n" + section + "\n")[1].split("\n\n")[0]
        return {line[2:].split("  ")[0]: line for line in block.splitlines()}

    # 1 x 1 is today's answer, data parallel section and all.
    assert main(base) == 0
    alone = capsys.readouterr().out
    assert main(base + ["--gpus-per-node", "1", "--nodes", "1"]) == 0
    same = capsys.readouterr().out
    assert rows(same, "predicted step") == rows(alone, "predicted step") and "data parallel" not in same
    # 2 GPUs x 2 nodes over NVLink and one NIC.
    assert main(base + ["--gpus-per-node", "2", "--nodes", "2", "--interconnect", "nvlink4",
                        "--network", "400g-1nic", "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    dp = rows(text, "data parallel")
    assert "fits: yes" in text and "global batch 4," in text
    assert dp["ranks"].split()[1:4] == ["2", "x", "2"] and "= 4" in dp["ranks"]
    assert "450 GB/s" in dp["intra-node link"] and "50 GB/s" in dp["network"]
    assert "replicate: a full copy on each node fits" in dp["host state"]
    per_rank = float(rows(text, "predicted step")["tokens/s per rank"].split()[3].replace(",", ""))
    total = float(dp["global tokens/s"].split()[2].replace(",", ""))
    assert total == pytest.approx(4 * per_rank, rel=1e-3)  # both printed to the token
    schedule = Schedule.load(tmp_path / "out" / "schedule.json")
    assert (schedule.plan.data_parallel, schedule.plan.nodes, schedule.plan.host_state) == (4, 2, "replicate")
    # A host that holds half the state but not all of it: sharded, with the reason.
    assert main(base + ["--nodes", "2", "--network", "400g-1nic", "--host-memory", "320KiB"]) == 0
    text = capsys.readouterr().out
    assert ("shard: replicating does not fit (a full copy of the masters and moments, 289.88 KiB, and 1 ranks' "
            "smallest buffers need at least") in text and "of the node's 320.00 KiB" in text
    # What is missing is named, with the flag that gives it.
    for extra, want in [(["--nodes", "2"], "network_bytes_per_s=0.*--network"),
                        (["--gpus-per-node", "2"], "intra_node_bytes_per_s=0.*--interconnect"),
                        (["--gpus-per-node", "3"], "global batch 4 does not split over 3 GPUs"),
                        (["--nodes", "0"], "--nodes \\(0\\) must be >= 1"),
                        (["--nodes", "2", "--network", "10g"], "no network preset named '10g'"),
                        (["--nodes", "2", "--nvme", "4xgen4"], "--nvme with several GPUs is not planned yet")]:
        rc = main(base + extra)
        out = capsys.readouterr()
        if "does not split" in want:
            assert rc == 3 and "fits: NO" in out.out, out
            assert re.search(want, out.out), out.out
        else:
            assert rc == 2 and re.search(want, out.err), (extra, out.err)


def test_plan_help_says_which_flags_are_required(capsys):
    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Required: --model, --hardware, --seq-len and --global-batch; or --config RUN" in text
    for flag in ("--model MODEL", "--seq-len SEQ_LEN", "--global-batch GLOBAL_BATCH"):
        assert f"{flag} required without --config" in text, flag
    assert "--hardware HARDWARE required (with --config, where the run names none)" in text


def test_train_reports_a_missing_data_path_before_importing_torch(tmp_path):
    """docs/failures.md's command, and the other cheap checks (megatrain.train.early): a missing
    data path, a malformed first record of a .jsonl corpus and of SFT data, a model that is no
    preset or file, a config.json that is not JSON are each one `error:` line, exit 2, from a
    process that never imported torch, transformers or datasets (the order, not a time: on this
    2-core machine each took 0.3-0.7 s at a load of 9, 0.9-2.0 s at 12, where the run reached them
    after 22-32 s)."""
    import subprocess
    import sys

    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "broken.json").write_text("{not json")
    cases = [
        (["--data", "no-such-corpus/"], "error: data: corpus path 'no-such-corpus' does not exist; expected a directory"),
        (["--data", "bad.jsonl"], "error: data: 'bad.jsonl', line 2: JSON value has no field 'text'"),
        (["--task", "sft", "--data", "chats.jsonl"], "error: data: 'chats.jsonl', record 1 (line 1): the chat has no "
                                                     "assistant message"),
        (["--model", "no-such-model"], "error: model 'no-such-model' is neither a preset"),
        (["--model", "broken.json"], "error: broken.json is not valid JSON"),
        (["--init-from", "no-such-dir"], "error: init_from no-such-dir is not a directory with a config.json"),
    ]
    code = ("import contextlib, io, json, sys\nfrom megatrain.cli import main\nout = []\n"
            f"for argv in {[argv for argv, _ in cases]!r}:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n"
            "        rc = main(['train', '--model', 'llama-30m', '--output-dir', 'runs/x', *argv])\n"
            "    out.append([rc, err.getvalue()])\n"
            "print(json.dumps([out, sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules)]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    results, imported = json.loads(p.stdout.strip().splitlines()[-1])
    assert imported == []
    for (argv, expected), (rc, err) in zip(cases, results):
        assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(expected), (argv, err)
    assert not (tmp_path / "runs").exists(), "the writable check leaves output_dir as it was"


def test_the_early_checks_pass_every_bundled_dataset(tmp_path):
    """What the run would accept, the early checks accept: every entry of the bundled registry and
    every file of examples/data (each read past its first records by tests/test_sft.py)."""
    from pathlib import Path

    from megatrain.train.config import TrainConfig
    from megatrain.train.early import check_inputs

    data = Path(__file__).resolve().parent.parent / "examples" / "data"
    for spec in [str(data), *(str(p) for p in sorted(data.glob("*_demo.*")))]:
        check_inputs(TrainConfig(model="llama-30m", task="sft", data=spec, output_dir=str(tmp_path / "out")))
    check_inputs(TrainConfig(model="llama-30m", output_dir=str(tmp_path / "out")))  # the standard library


def test_a_cpu_plans_memory_table_has_no_gpu_reserve():
    """The reserve is CUDA's (context, cuBLAS workspaces, caching allocator): a plan for the CPU
    backend and no GPU has none and its table lists none; a plan with a GPU's spec keeps its derived
    reserve, and the report says what it is for."""
    from conftest import tiny_llama
    from megatrain.cli import format_report
    from megatrain.planner.front import PlanRequest, plan

    model = tiny_llama(layers=2, device="meta")
    cpu = plan(PlanRequest(model, 16, 2, micro_batch_size=2, device="cpu", plan="default"))
    gpu = plan(PlanRequest(model, 16, 2, micro_batch_size=2, hardware="H100_SXM", device="cpu", plan="default"))
    assert cpu.memory.reserve == 0 and cpu.memory.reserve_parts is None and "reserve" not in cpu.memory.format()
    assert cpu.memory.gpu_peak == gpu.memory.on_cpu().gpu_peak < gpu.memory.gpu_peak
    assert gpu.memory.reserve > 1 << 30 and "reserve: CUDA context, workspaces, allocator" in gpu.memory.format()
    rows = {line.split()[0]: line for line in format_report(gpu, gpu.hardware, model="tiny").splitlines()
            if line.startswith("  ")}
    assert "held for CUDA beyond the plan's tensors" in rows["reserve"] and "reserve included" in rows["peak"]
