"""tests/ranks.py itself: a run in which a rank dies of a signal is started once more, with a warning, and a second
crash fails the scenarios' tests as any abort does."""

import os
import signal

import pytest
import ranks

pytestmark = pytest.mark.skipif(
    not ranks.gloo_available(),
    reason="needs torch.distributed with the gloo backend, which this torch build lacks",
)

FLAG_ENV = "FLATOPT_TEST_RANKS_FLAG"  # a file: rank 1 crashes while it does not exist (and creates it first)


def crash_once(rank):
    flag = os.environ[FLAG_ENV]
    if rank == 1 and not os.path.exists(flag):
        open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return {"rank": rank}


def crash_always(rank):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return {"rank": rank}


ONCE = {"once": (crash_once, ())}
ALWAYS = {"always": (crash_always, ())}


def test_a_rank_that_died_of_a_signal_is_run_again_once(tmp_path, monkeypatch):
    monkeypatch.setenv(FLAG_ENV, str(tmp_path / "crashed"))  # inherited by the spawned ranks
    out = tmp_path / "run"
    out.mkdir()
    with pytest.warns(UserWarning, match="SIGSEGV") as caught:
        results = ranks.run("test_ranks", 2, str(out), 120, table="ONCE")
    message = str(caught[0].message)
    assert "once more" in message
    assert "crash.rank1.txt" in message and "in crash_once" in message, "the warning lacks the crashed rank's stack"
    assert (tmp_path / "crashed").exists(), "rank 1 crashed on the first run"
    assert [r["rank"] for r in results("once")] == [0, 1]


def test_a_second_crash_fails(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with pytest.warns(UserWarning, match="once more"):
        results = ranks.run("test_ranks", 2, str(out), 120, table="ALWAYS")
    with pytest.raises(pytest.fail.Exception, match="(?s)SIGSEGV.*in crash_always"):
        results("always")
