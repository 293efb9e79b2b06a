"""Running test scenarios on several CPU ranks (gloo): the processes are started once per test module with
torch.multiprocessing (spawn) and a FileStore in a temporary directory (no TCP port to pick).

Every rank runs every scenario of ``SCENARIOS`` ({name: (function, args)}) of the test module named, in
order, in one group of processes (a spawn costs seconds of imports); each scenario's result, or the
traceback it raised, goes to a file per rank, and the tests read them with :class:`Results`. An exception
in a rank stops that rank, so that the others never wait in a collective that will not come (gloo's
timeout ends their wait); the scenarios after it then fail saying so. The whole run has a deadline, past
which the ranks are killed. Each rank writes every thread's Python stack to ``crash.rank<r>.txt`` in the output
directory if it dies of a signal (faulthandler; a file, since pytest drops a passing test's captured output).
A run in which a rank died of a signal (a crash inside torch.distributed or a kernel, not an exception) is
started once more, with a warning quoting the crash and those stacks; a second crash fails the tests as any
abort does, with the stacks in its message.
"""

import faulthandler
import glob
import importlib
import os
import time
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def gloo_available():
    return dist.is_available() and dist.is_gloo_available()


def worker(rank, world, module, table, store_file, out_dir):
    """One rank: every scenario of ``module``'s ``table`` in order; results (or the traceback) to
    ``out_dir/<scenario>.rank<r>.pt``."""
    crash_log = open(os.path.join(out_dir, f"crash.rank{rank}.txt"), "w")  # noqa: SIM115 (open until the rank exits)
    faulthandler.enable(file=crash_log)  # a crash writes where each thread was
    torch.set_num_threads(1)
    scenarios = getattr(importlib.import_module(module), table)
    dist.init_process_group(
        "gloo", init_method=f"file://{store_file}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        for name, (fn, args) in scenarios.items():
            path = os.path.join(out_dir, f"{name}.rank{rank}.pt")
            try:
                result = fn(rank, *args)
            except BaseException:
                torch.save({"error": traceback.format_exc()}, path)
                raise  # another rank may be waiting in a collective of this scenario: stop them all
            torch.save(result, path)
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


class Results:
    """The results of one run: ``results(name)`` is every rank's result of scenario ``name``."""

    def __init__(self, out_dir, world, abort):
        self.out_dir, self.world, self.abort = out_dir, world, abort

    def __call__(self, name):
        """Every rank's results of scenario ``name``; fails the test with a rank's traceback if it raised."""
        per_rank = []
        for rank in range(self.world):
            path = os.path.join(self.out_dir, f"{name}.rank{rank}.pt")
            if not os.path.exists(path):
                pytest.fail(f"scenario {name!r} did not run on rank {rank}; the ranks stopped with:\n{self.abort}")
            result = torch.load(path, weights_only=False)
            if "error" in result:
                pytest.fail(f"rank {rank} raised in scenario {name!r}:\n{result['error']}")
            per_rank.append(result)
        return per_rank


def run(module, world, out_dir, timeout_s, table="SCENARIOS"):
    """Run the scenarios of test module ``module`` (its dict ``table``) on ``world`` ranks; returns their
    :class:`Results`. Once more if a rank died of a signal (see the module docstring)."""
    abort, crashed = _run_once(module, world, out_dir, timeout_s, table)
    if crashed:
        warnings.warn(f"ranks.run({module!r}, {world}): {abort}; running its scenarios once more", stacklevel=2)
        for path in glob.glob(os.path.join(out_dir, "*.rank*.*")) + [os.path.join(out_dir, "store")]:
            if os.path.exists(path):
                os.remove(path)
        abort, _ = _run_once(module, world, out_dir, timeout_s, table)
    return Results(out_dir, world, abort)


def _run_once(module, world, out_dir, timeout_s, table):
    """One run: (why it stopped early or None, whether a rank died of a signal)."""
    ctx = mp.start_processes(
        worker, args=(world, module, table, os.path.join(out_dir, "store"), out_dir), nprocs=world, join=False
    )
    abort, crashed = None, False
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                abort = f"the ranks did not finish within {timeout_s} s and were killed"
                break
    except mp.ProcessExitedException as e:  # a rank died without raising: a signal, or os._exit
        abort, crashed = f"{type(e).__name__}: {e}{_crash_stacks(out_dir)}", e.signal_name is not None
    except Exception as e:  # torch.multiprocessing's ProcessRaisedException carries the rank's traceback
        abort = f"{type(e).__name__}: {e}"
    return abort, crashed


def _crash_stacks(out_dir):
    """What faulthandler wrote for each rank that crashed (see :func:`worker`), or ""."""
    out = ""
    for path in sorted(glob.glob(os.path.join(out_dir, "crash.rank*.txt"))):
        with open(path) as f:
            text = f.read().strip()
        if text:
            out += f"\n--- {os.path.basename(path)}:\n{text}"
    return out


def assert_history(ours, theirs, what, **tol):
    """Parameters and every state tensor of two histories (lists of snapshots: {"params": [tensors], "state":
    torch.optim's state_dict()["state"], ``step`` as a float}) agree at every step."""
    __tracebackhide__ = True  # the failure shows at the test's line, without the histories' reprs
    assert len(ours) == len(theirs), f"{what}: {len(ours)} steps against {len(theirs)}"
    for step, (a, b) in enumerate(zip(ours, theirs), start=1):
        for i, (p, q) in enumerate(zip(a["params"], b["params"], strict=True)):
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{what}, step {step}, parameter {i}: {m}")
        assert a["state"].keys() == b["state"].keys(), f"{what}, step {step}: stepped parameters differ"
        for i, entry in a["state"].items():
            assert entry.keys() == b["state"][i].keys(), f"{what}, step {step}, parameter {i}: state names"
            for key, value in entry.items():
                other = b["state"][i][key]
                if key == "step":
                    assert value == other, f"{what}, step {step}, parameter {i}: step count {value} != {other}"
                else:
                    torch.testing.assert_close(
                        value, other, **tol, msg=lambda m: f"{what}, step {step}, parameter {i}, {key}: {m}"
                    )
