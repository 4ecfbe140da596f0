"""What an engine child's close waits for (``kvtierd.testing.vllm_process``): a process group
is alive while a member runs, and not once its members are dead or zombies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kvtierd.testing.vllm_process import _group_alive, _wait_for_group

#: A session leader that leaves a child behind in its group and exits: the child, reparented,
#: is the group's only live member.
LEAVES_A_CHILD = (
    "import subprocess, sys; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "print('started', flush=True)"
)


def test_a_group_is_alive_until_its_last_member_dies() -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEAVES_A_CHILD], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert leader.stdout is not None
        assert leader.stdout.readline().strip() == b"started"
        leader.wait(30)
        assert _group_alive(leader.pid)  # the leader is reaped, its child still runs
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        if leader.stdout is not None:
            leader.stdout.close()
    _wait_for_group(leader.pid, timeout_s=30)
    assert not _group_alive(leader.pid)
