"""A run's directory under failure: nothing deletes a checkpoint that holds trained weights, files
are written atomically, one run at a time holds ``output_dir`` (the error names the other), and
what a killed run leaves behind does not stop the same command (``megatrain.train.rundir``,
``megatrain.files``)."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest

import megatrain.runtime.measure
from megatrain.cli import main
from megatrain.files import DirectoryLock, DiskFullError, LockedError, write_atomic

from train_runs import error_line, quick_matmul_probe, write_run  # noqa: F401 (an autouse fixture)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("rundir"), warmup_steps=1, eval_interval=0, checkpoint_interval=2)


def run(setup: Path, out: Path, *extra: str) -> int:
    return main(["train", "--config", str(setup / "run.yaml"), "--output-dir", str(out), "--max-steps", "4", *extra])


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "out"
    megatrain.runtime.measure.MATMUL_SECONDS, keep = 0.02, megatrain.runtime.measure.MATMUL_SECONDS
    try:
        assert run(setup, out) == 0
    finally:
        megatrain.runtime.measure.MATMUL_SECONDS = keep
    return out


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != ".megatrain.lock"}


@pytest.mark.parametrize("lost", [["megatrain_state/manifest.json"],
                                  ["megatrain_state/manifest.json", "megatrain_state/optimizer.safetensors"]],
                         ids=["manifest", "manifest-and-optimizer"])
def test_an_incomplete_checkpoint_is_reported_and_kept(finished, setup, tmp_path, capsys, lost):
    """The issue: a checkpoint missing only its manifest made the same command delete it (a 60-step
    checkpoint and metrics.jsonl) and start over."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    for f in lost:
        (out / "checkpoint" / f).unlink()
    before = snapshot(out)
    assert run(setup, out, "--max-steps", "6") == 2
    line = error_line(capsys.readouterr().err)
    assert "checkpoint is not a complete checkpoint: it lacks " in line and "left as it is" in line
    assert ("it lacks only megatrain_state/manifest.json" in line) == (len(lost) == 1)
    assert all(f in line for f in lost)
    assert "put the missing files back" in line and "move it away" in line
    assert snapshot(out) == before  # nothing removed or rewritten


def test_a_finished_run_exits_0_and_another_process_is_kept_out_naming_it(finished, setup, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    assert run(setup, out) == 0
    assert "finished at step 4 (max_steps 4): nothing to do" in capsys.readouterr().out
    with DirectoryLock(out / ".megatrain.lock", "output_dir"):  # another run holds it
        assert run(setup, out, "--max-steps", "6") == 2
        line = error_line(capsys.readouterr().err)
    assert f"output_dir {out} is in use by pid {os.getpid()} on host " in line and "choose another" in line
    assert run(setup, out, "--max-steps", "6") == 0  # released: the run goes on


def test_what_a_killed_run_leaves_does_not_stop_the_same_command(finished, setup, tmp_path, capsys):
    """A kill while building the token store leaves ``.tokens.tmp-*`` (it made the same command
    refuse the directory), one during an atomic write a ``.<name>.tmp-*`` file."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    (out / ".tokens.tmp-0123abcd").mkdir()
    (out / ".tokens.tmp-0123abcd" / "shard000000.bin").write_bytes(b"x")
    (out / ".metrics.jsonl.tmp-89ab").write_text("{")
    assert run(setup, out, "--max-steps", "6") == 0
    assert "resume: " in capsys.readouterr().out
    fresh = tmp_path / "fresh"
    (fresh / ".tokens.tmp-0123abcd").mkdir(parents=True)
    assert run(setup, fresh) == 0


def test_write_atomic_leaves_the_old_file_when_interrupted_and_names_a_full_disk(tmp_path, monkeypatch):
    f = tmp_path / "metrics.jsonl"
    f.write_text("history\n")

    def killed(fd):
        raise KeyboardInterrupt  # as a signal between the write and the rename

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(f, "")
    assert f.read_text() == "history\n"
    monkeypatch.undo()

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(DiskFullError, match=r"cannot write metrics.jsonl at .*: the disk is full \([\d,]+ bytes free"):
        write_atomic(f, "new\n")
    monkeypatch.undo()
    assert f.read_text() == "history\n" and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    write_atomic(f, "new\n")
    assert f.read_text() == "new\n"


def test_a_directory_lock_names_its_holder_and_is_released_when_its_process_ends(tmp_path):
    import subprocess
    import sys

    lock = DirectoryLock(tmp_path / ".lock", "data_cache x")
    child = subprocess.Popen([sys.executable, "-c", "import sys; from megatrain.files import DirectoryLock; "
                              f"DirectoryLock({str(tmp_path / '.lock')!r}, 'x').acquire(); print('held', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "held\n"
        with pytest.raises(LockedError, match=rf"data_cache x is in use by pid {child.pid} on host .* since "):
            lock.acquire()
    finally:
        child.kill()  # SIGKILL: the kernel releases the lock
        child.wait()
    lock.acquire()
    assert lock.held and f"pid {os.getpid()}" in lock.holder()
    lock.release()


@pytest.mark.parametrize("planted", ["hard link", "symlink", "fifo", "directory"])
def test_a_lock_file_planted_in_a_shared_directory_is_refused_and_its_target_untouched(tmp_path, planted):
    """Issue 44, item 3: a hard link planted as ``.tokens.lock`` in a shared data_cache used to be
    opened read-write and truncated, overwriting its target. A lock file that is a hard link, a
    symlink, a FIFO (which must not block) or not a file is refused naming it and the fix; the
    target keeps its bytes."""
    from megatrain.files import UnsafeFileError

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    cache = tmp_path / "data_cache"
    cache.mkdir()
    lock_file = cache / ".tokens.lock"
    {"hard link": lambda: os.link(target, lock_file), "symlink": lambda: lock_file.symlink_to(target),
     "fifo": lambda: os.mkfifo(lock_file), "directory": lambda: lock_file.mkdir()}[planted]()
    why = {"hard link": "has 2 hard links", "symlink": "is a symbolic link", "fifo": r"is not a regular file \(p",
           "directory": r"is not a regular file \(d"}[planted]
    with pytest.raises(UnsafeFileError, match=rf"the lock file of the token store x, {re.escape(str(lock_file))}, "
                                              rf"{why}.*remove it \(rm "):
        DirectoryLock(lock_file, "the token store x").acquire()
    assert target.read_text() == "keep me\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
def test_another_users_lock_file_in_a_shared_directory_locks_and_is_never_written(tmp_path):
    lock_file = tmp_path / ".tokens.lock"
    lock_file.write_text("pid 1 on host other since then\n")
    os.chown(lock_file, 12345, 12345)
    with DirectoryLock(lock_file, "the token store x") as lock:
        assert lock.held and lock_file.read_text() == "pid 1 on host other since then\n"
        with pytest.raises(LockedError, match="the token store x is in use by pid 1 on host other"):
            DirectoryLock(lock_file, "the token store x").acquire()


def test_a_lock_file_of_this_user_is_reused_and_names_its_holder(tmp_path):
    lock_file = tmp_path / ".lock"
    lock_file.write_text("pid 1 on host old since then\n" * 100)  # a last holder's record, longer than ours
    with DirectoryLock(lock_file, "x") as lock:
        assert lock.holder().startswith(f"pid {os.getpid()} on host") and lock_file.read_text().count("\n") == 1


def _children(pid: int) -> list[int]:
    """The tokenizer workers of process ``pid`` (multiprocessing's spawned children)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _corpus_and_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """Two 4 MB files (two shards of seconds of tokenising each) and a small BPE for them."""
    import random

    from megatrain.data import train_bpe_tokenizer

    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghij", k=rng.randint(2, 9))) for _ in range(3000)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(2):
        (corpus / f"{i}.txt").write_text(" ".join(rng.choices(words, k=600_000)))
    tok = tmp_path / "tokenizer.json"
    train_bpe_tokenizer([" ".join(words)], vocab_size=320).save(str(tok))
    return corpus, tok


def _wait_for_workers(pid: int, store: Path, alive=lambda: True) -> list[int]:
    """The workers of ``pid`` once they tokenise (a shard file exists in the store's temporary directory)."""
    import time

    deadline, workers = time.monotonic() + 120, []
    while not workers or not list(store.parent.glob(f".{store.name}.tmp-*/shard*")):
        assert alive() and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
        workers = workers or _children(pid)
    return workers


def _assert_gone(workers: list[int], within: float) -> None:
    import time

    deadline = time.monotonic() + within
    while any(_alive(w) for w in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the build"
        time.sleep(0.05)


LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")


@LINUX_PROC
def test_sigterm_while_the_token_store_is_built_cleans_up_and_exits_143(setup, tmp_path, capsys):
    """It exited 143 at once, leaving the temporary store (which made the same command refuse
    output_dir) and its workers tokenising on. A real SIGTERM, to this process, from a thread."""
    import signal
    import threading

    corpus, tok = _corpus_and_tokenizer(tmp_path)
    out = tmp_path / "out"
    workers: list[int] = []

    def terminate():
        workers.extend(_wait_for_workers(os.getpid(), out / "tokens"))
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=terminate, daemon=True)
    t.start()
    assert run(setup, out, "--data", str(corpus), "--tokenizer", str(tok), "--max-bytes", "none") == 143
    t.join()
    assert "error: interrupted (SIGTERM)" in error_line(capsys.readouterr().err)
    _assert_gone(workers, within=10)  # Pool.terminate() signals and joins them
    assert not list(out.glob(".tokens.tmp-*"))


@LINUX_PROC
def test_workers_die_with_a_killed_build(tmp_path):
    """SIGKILL cannot be handled: the kernel kills the workers with their parent (PR_SET_PDEATHSIG),
    rather than each tokenising its shard on (seconds here, minutes for a large corpus)."""
    import subprocess
    import sys

    corpus, tok = _corpus_and_tokenizer(tmp_path)
    store = tmp_path / "tokens"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from megatrain.data import build_token_store, "
                             "load_tokenizer; build_token_store(sys.argv[1], load_tokenizer(sys.argv[2]), sys.argv[3], "
                             "workers=2, progress=False)", str(corpus), str(tok), str(store)])
    try:
        workers = _wait_for_workers(proc.pid, store, alive=lambda: proc.poll() is None)
    finally:
        proc.kill()
        proc.wait()
    _assert_gone(workers, within=1.5)


def test_too_little_disk_for_a_checkpoint_is_refused_before_the_data(setup, tmp_path, capsys, monkeypatch):
    import shutil as sh

    class Usage:
        free = 10_000

    real = sh.disk_usage
    monkeypatch.setattr(sh, "disk_usage", lambda p: Usage if str(p).startswith(str(tmp_path)) else real(p))
    out = tmp_path / "out"
    assert run(setup, out) == 2
    line = error_line(capsys.readouterr().err)
    assert "not enough disk space for a checkpoint: one takes about" in line and "9.77 KiB free" in line
    assert not (out / "tokens").exists()  # refused before the data was prepared


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full: writes fail with ENOSPC (Linux)")
def test_a_full_disk_while_writing_metrics_says_so():
    from megatrain.train.metrics import MetricsLog

    log = MetricsLog(Path("/dev/full"))
    with pytest.raises(DiskFullError, match=r"cannot write full at /dev/full: the disk is full \("):
        log.append({"step": 1, "loss": 2.0})
