"""The manual's two-node rehearsal (docs/training.md), run as written: two torchrun launchers
(one per "node") with a c10d rendezvous on loopback train one run folder over gloo and
checkpoint; the run then resumes on one node with the same global batch and finishes."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import COMMON, TESTS, newest, records, write_colours

README = TESTS.parent / "docs" / "training.md"
_BATCH = COMMON.index("--batch-size")
TINY = COMMON[:_BATCH] + COMMON[_BATCH + 2 :]  # the tiny model's flags; the README sets the batch
README_DATA, README_RUN, README_PORT = "data/pets-lmdb", "runs/rehearsal", "29400"


def rehearsal_commands() -> tuple[list[str], str]:
    """The README's block with the c10d rendezvous: the torchrun lines, and the resume line."""
    readme = README.read_text()
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "c10d" in b]
    assert blocks, "docs/training.md lacks the multi-node rehearsal (a bash block with c10d)"
    lines = [line for line in blocks[0].splitlines() if line and not line.startswith("#")]
    launchers = [line for line in lines if line.startswith("torchrun ")]
    (resume,) = [line for line in lines if line.startswith("dlpipe train --config")]
    assert (
        len(launchers) == 2 and "--node-rank 0" in launchers[0] and "--node-rank 1" in launchers[1]
    )
    return launchers, resume


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _here(command: str, data: str, run: Path, port: int) -> list[str]:
    """A README line with this test's dataset, run folder and a free port."""
    text = command.replace(README_DATA, data).replace(README_RUN, str(run))
    return shlex.split(text.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}"))


@pytest.mark.slow
def test_two_nodes_on_loopback_checkpoint_and_the_run_resumes_on_one(tmp_path) -> None:
    launchers, resume = rehearsal_commands()
    data = write_colours(tmp_path / "lmdb", "lmdb")
    run, port = tmp_path / "run", free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(TESTS),  # trainer_models, the tiny model
    }
    nodes = [
        subprocess.Popen(
            [*_here(line, data, run, port), *TINY, "--dist-timeout", "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for line in launchers
    ]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    printed = "".join(out for out, _ in outputs)
    assert "global batch 32 = 2 ranks x micro-batch 16 x 1 accumulation steps" in printed
    state = newest(run)
    assert state["step"] == 3 and state["world_size"] == 2 and len(state["ranks"]) == 2
    assert state["reason"] == "max_steps"

    done = subprocess.run(
        _here(resume, data, run, port), capture_output=True, text=True, cwd=tmp_path, env=env,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 32 = 1 rank x micro-batch 32 x 1 accumulation steps" in done.stdout
    assert "(step 3, epoch 1, saved by 2 ranks, now on 1)" in done.stdout
    final = newest(run)
    assert final["step"] == 6 and final["epoch"] == 2 and final["world_size"] == 1
    assert [r["saved_world_size"] for r in records(run, "resume")] == [2]
    steps = [r["step"] for r in records(run, "step")]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step once: the two nodes logged one timeline
