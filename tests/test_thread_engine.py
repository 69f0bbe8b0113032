"""The thread engine: the same batches as the 0-worker loader, from threads in this process."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch
from conftest import FORMAT_NAMES, batch_list, rank_keys, write_dataset

import dlpipe
from dlpipe.errors import FieldDecodeError
from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.profile import LoaderProfile, ProfileError, loader_key, machine_key

THREADS = dlpipe.WorkerSettings(num_workers=2, engine="threads")


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(lx, ly) for (x, lx), (y, ly) in zip(a, b)
    )


def _loader(path, workers):
    config = dlpipe.LoaderConfig(batch_size=4, image_size=24, seed=5)
    return dlpipe.make_loader(path, "train", config, workers=workers)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dlpipe-loader")]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_threads_give_the_zero_worker_batches_bit_for_bit(fmt, make_dataset) -> None:
    """Two epochs, train transform: same samples, same order, same augmentation."""
    path = make_dataset(fmt)
    inline = _loader(path, 0)
    threaded = _loader(path, THREADS)
    for _ in range(2):
        assert _same(batch_list(inline), batch_list(threaded))
    assert len(threaded) == len(inline) == 8
    threaded.close()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_threads_start_no_process_and_close_ends_their_threads(fmt, make_dataset) -> None:
    loader = _loader(make_dataset(fmt), THREADS)
    before = multiprocessing.active_children()
    iterator = iter(loader)
    next(iterator)
    assert multiprocessing.active_children() == before  # no fork, no spawn
    assert 1 <= len(_engine_threads()) <= 2
    loader.close()
    for thread in _engine_threads():
        thread.join(timeout=600)  # a bound on a hang only: close() ends them
    assert not _engine_threads()
    assert len(batch_list(loader)) == 8  # a closed loader starts its pool again


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize(("saver", "resumer"), [("threads", "threads"), ("threads", "workers")])
def test_a_thread_engine_state_resumes_exactly(fmt, saver, resumer, make_dataset) -> None:
    """Saved mid-epoch (after batches were already queued ahead), resumed by a thread
    loader or a process-worker one: the rest of the epoch and the next are the
    uninterrupted run's."""
    path = make_dataset(fmt)
    engines = {"threads": THREADS, "workers": dlpipe.WorkerSettings(num_workers=2)}
    reference = _loader(path, engines[saver])
    iterator = iter(reference)
    _ = [next(iterator) for _ in range(3)]
    state = reference.state_dict()
    rest = [(x.clone(), y.clone()) for x, y in iterator] + batch_list(reference)
    resumed = _loader(path, engines[resumer])
    resumed.load_state_dict(state)
    again = batch_list(resumed) + batch_list(resumed)
    if fmt == "wds" and resumer == "workers":  # another worker count: the same samples
        keys = sorted(int(label) for _, labels in rest for label in labels)
        assert keys == sorted(int(label) for _, labels in again for label in labels)
    else:
        assert _same(rest, again)
    reference.close(), resumed.close()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_ranks_on_threads_are_the_zero_worker_ranks(fmt, tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", fmt, {"train": samples[:37]}, max_shard_samples=5)
    keys = []
    for rank in range(2):
        ours = rank_keys(path, rank, workers=THREADS)
        assert ours == rank_keys(path, rank, workers=0) and len(ours) == 16
        keys.append(set(ours))
    assert not keys[0] & keys[1]


def test_a_sample_that_does_not_decode_is_the_same_named_error(tmp_path, samples) -> None:
    broken = [dict(s) for s in samples[:12]]
    broken[5]["jpg"] = b"\xff\xd8\xff\xe0 not a jpeg at all"
    path = write_dataset(tmp_path / "d", "lmdb", {"train": broken})
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, image_size=24, shuffle=False),
        workers=THREADS,
    )
    with pytest.raises(FieldDecodeError, match=repr(broken[5]["__key__"])):
        list(loader)
    loader.close()


def test_the_engine_keyword_overrides_the_settings(make_dataset) -> None:
    loader = dlpipe.make_loader(
        make_dataset("lmdb"),
        "train",
        dlpipe.LoaderConfig(batch_size=4),
        workers={"num_workers": 3, "engine": "threads"},
    )
    threads = loader._stages.threads
    assert threads is not None and threads.threads == 3 and loader.num_workers == 0
    with pytest.raises(LoaderConfigError, match="engine='greenlets'"):
        dlpipe.make_loader(
            make_dataset("wds"),
            "train",
            dlpipe.LoaderConfig(batch_size=4),
            workers={"engine": "greenlets"},
        )


def test_a_custom_transform_runs_on_the_threads(make_dataset) -> None:
    seen: set[str] = set()

    def label_only(sample):
        seen.add(threading.current_thread().name)
        return int(sample["cls"])

    path = make_dataset("hdf5")
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, transform=label_only, shuffle=False),
        workers=THREADS,
    )
    inline = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, transform=label_only, shuffle=False),
        workers=0,
    )
    assert [b.tolist() for b in loader] == [b.tolist() for b in inline]
    assert any(name.startswith("dlpipe-loader") for name in seen)


MAIN = dlpipe.WorkerSettings(num_workers=0)


@pytest.mark.parametrize(("workers", "fmt"), [(THREADS, "lmdb"), (MAIN, "lmdb"), (MAIN, "wds")])
def test_loading_threads_run_torch_ops_on_one_thread_and_the_caller_keeps_its_own(
    workers, fmt, make_dataset, monkeypatch
) -> None:
    """As in a DataLoader worker process, a loader thread's torch ops do not start a team of
    their own (threads x cores on the cores), and neither does the caller's thread where the
    loader works in it (0 workers: everything; the thread engine: the collate), whose team
    spun against the loading threads; the trainer's thread count is untouched, between
    batches as after them."""
    from dlpipe.loading import stages

    counts: set[int] = set()

    def label_only(sample):
        counts.add(torch.get_num_threads())
        return int(sample["cls"])

    def recorded(items):
        counts.add(torch.get_num_threads())
        return real(items)

    real = stages.collate
    monkeypatch.setattr(stages, "collate", recorded)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = dlpipe.LoaderConfig(batch_size=4, transform=label_only)
        loader = dlpipe.make_loader(make_dataset(fmt), "train", config, workers=workers)
        between = {torch.get_num_threads() for batch in loader}
        assert counts == {1} and between == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine": "fibres"}, r"engine='fibres' is not 'processes' or 'threads'"),
        ({"engine": "threads", "num_workers": 0}, r"num_workers=0 is not 1 or more"),
    ],
)
def test_bad_engine_settings_are_named(fields, message) -> None:
    with pytest.raises(LoaderConfigError, match=message):
        dlpipe.WorkerSettings(**{"num_workers": 2, **fields})


def test_a_profile_keeps_its_engine_and_an_old_one_reads_as_processes() -> None:
    key = loader_key("train", dlpipe.LoaderConfig())
    profile = LoaderProfile(settings=THREADS, samples_per_s=1.0, machine=machine_key(), loader=key)
    stored = profile.to_json()
    assert stored["engine"] == "threads"
    assert LoaderProfile.from_json(stored).settings == THREADS
    with pytest.raises(ProfileError, match="engine=.fork bomb. is not"):
        LoaderProfile.from_json({**stored, "engine": "fork bomb"})
    del stored["engine"]
    assert LoaderProfile.from_json(stored).settings.engine == "processes"


EXIT_SCRIPT = """
import gc, itertools, os, sys, threading, time
import dlpipe
from dlpipe.loading import threads

threads.EXIT_WAIT_S = float(sys.argv[3])
marker = sys.argv[2]
calls, lock = itertools.count(), threading.Lock()

def transform(sample):
    with lock:
        call = next(calls)
    if call >= 2:  # after the first batch: a slow (or hung) transform on a pool thread
        with open(marker, "a") as f:
            f.write("started\\n")
        time.sleep(float(sys.argv[4]))
        with open(marker, "a") as f:
            f.write("done\\n")
    return sample["__key__"]

config = dlpipe.LoaderConfig(batch_size=2, transform=transform)
workers = dlpipe.WorkerSettings(num_workers=2, engine="threads")
loader = dlpipe.make_loader(sys.argv[1], "train", config, workers=workers)
batches = iter(loader)
next(batches)  # the next batch's calls are queued ahead
while not os.path.exists(marker) or "started" not in open(marker).read():
    time.sleep(0.01)  # a slow call is running
if sys.argv[5] == "close":  # the pool is shut down and collected, its call still running
    loader.close()
    del loader, batches
    gc.collect()
print("left the loop")  # the interpreter exits with the pool's calls running
"""


def _exit_run(path, tmp_path, wait_s: float, sleep_s: float, close: bool = False):
    import subprocess
    import sys

    marker = tmp_path / "calls"
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    args = [sys.executable, str(script), str(path), str(marker), str(wait_s), str(sleep_s)]
    args.append("close" if close else "open")
    run = subprocess.run(args, capture_output=True, text=True, timeout=240)
    return run, (marker.read_text().count("done") if marker.exists() else 0)


@pytest.mark.parametrize("close", [False, True], ids=["loop left", "loader closed"])
def test_at_exit_the_pool_threads_finish_their_calls_instead_of_being_killed(
    make_dataset, tmp_path, close
) -> None:
    """A loop left without close(), or a loader closed (its pool shut down and collected)
    just before the exit: at interpreter exit the pool threads' running calls end (a daemon
    thread killed inside a torch op aborts the process: exit 134)."""
    path = make_dataset("lmdb")
    run, done = _exit_run(path, tmp_path, wait_s=60, sleep_s=0.5, close=close)
    assert run.returncode == 0 and "left the loop" in run.stdout, run.stderr
    assert done >= 1  # calls still running when the loop was left were let finish


def test_a_hung_transform_does_not_keep_the_process_alive_at_exit(make_dataset, tmp_path) -> None:
    path = make_dataset("lmdb")
    run, done = _exit_run(path, tmp_path, wait_s=0.2, sleep_s=3600)  # times out if kept alive
    assert run.returncode == 0 and "left the loop" in run.stdout, run.stderr
    assert done == 0


def test_a_pool_thread_keeps_one_torch_thread_when_the_caller_sets_its_own() -> None:
    """torch gives a thread the process-wide count at its first torch call: a pool thread's
    count of 1 must survive the caller setting its own count afterwards."""
    from dlpipe.loading.threads import DaemonPool, _one_torch_thread

    started, go = threading.Event(), threading.Event()

    def count_after_the_caller_set_its_own() -> int:
        started.set()
        go.wait(60)
        return torch.get_num_threads()

    before = torch.get_num_threads()
    pool = DaemonPool(1, "dlpipe-loader-test", _one_torch_thread)
    try:
        future = pool.submit(count_after_the_caller_set_its_own)
        assert started.wait(60)
        torch.set_num_threads(2)  # as the caller's count comes back after a batch
        go.set()
        assert future.result(60) == 1
    finally:
        pool.shutdown()
        torch.set_num_threads(before)
