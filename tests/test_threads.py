"""The CPU backend's threads (megatrain.runtime.threads): the passive OpenMP wait policy is asked for
before torch loads and never over the user's choice, the thread count follows the setting, then
OMP_NUM_THREADS, then the CPUs available, and oversubscription is reported from the load average."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatrain.errors import ConfigError
from megatrain.runtime import threads as T


def _child(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_the_passive_wait_policy_is_set_before_torch_loads_and_never_over_the_users():
    probe = ("import os\nfrom megatrain.runtime.threads import prefer_passive_wait\n"
             "{first}ok = prefer_passive_wait()\nimport torch\nprint(ok, os.environ.get('OMP_WAIT_POLICY'))")
    assert _child(probe.format(first="")) == "True PASSIVE"
    assert _child(probe.format(first=""), OMP_WAIT_POLICY="active") == "False active"
    # torch (and so OpenMP) loaded first: too late to ask, and the answer says so.
    assert _child(probe.format(first="import torch\n")) == "False None"
    # The command line asks before it imports anything heavy.
    assert _child("import os, sys\nfrom megatrain.cli import main\nmain(['--version'])\n"
                  "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)").endswith("PASSIVE False")


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_thread_count_is_the_setting_then_omp_num_threads_then_the_available_cpus(monkeypatch, keep_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = T.available_cpus()
    assert 1 <= cpus <= (os.cpu_count() or 1)
    choice = T.choose_threads()
    assert 1 <= choice.threads <= cpus and (choice.source, choice.cpus) == (T.CPUS_AVAILABLE, cpus)
    assert torch.get_num_threads() == choice.threads and "(one per CPU this process may use)" in choice.describe()
    T.choose_threads(1)  # a run with threads: 1, then one without: the same choice as before, not 1
    assert T.choose_threads().threads == choice.threads
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert (T.choose_threads().threads, T.choose_threads().source) == (1, "OMP_NUM_THREADS")
    assert (T.choose_threads(2).threads, T.choose_threads(2).source) == (2, "threads setting")
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS='many' is not a positive number"):
        T.choose_threads()


def test_a_spinning_wait_policy_is_named_with_the_fix():
    line = T.ThreadChoice(2, T.CPUS_AVAILABLE, "unset", 2).describe()
    assert "OpenMP wait policy unset (threads spin" in line and "set OMP_WAIT_POLICY=PASSIVE" in line
    assert T.ThreadChoice(1, "OMP_NUM_THREADS", "PASSIVE", 4).describe() == (
        "threads: 1 torch intra-op thread (OMP_NUM_THREADS; 4 CPUs available), OpenMP wait policy PASSIVE")


@pytest.mark.parametrize("load, cpus, note", [
    (2.9, 2, None),  # two busy threads on two CPUs and a little more: not oversubscribed
    (3.0, 2, "load 3.0 on 2 CPUs: oversubscribed"),  # one more runnable task than CPUs
    (11.2, 2, "load 11.2 on 2 CPUs: oversubscribed"),
    (40.0, 64, None),
])
def test_oversubscription_is_one_more_runnable_task_than_cpus(load, cpus, note):
    assert T.oversubscription(load, cpus) == note


def test_without_a_load_average_nothing_is_claimed(monkeypatch):
    monkeypatch.setattr(T, "load_average", lambda: None)
    assert T.oversubscription() is None
