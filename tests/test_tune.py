"""dlpipe bench-loader: stages, a short search, the verdict, the saved profile, the RAM budget."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

import dlpipe
from dlpipe import turbojpeg
from dlpipe.cli import main
from dlpipe.loading import tune, tune_search, tune_stages, verdicts
from dlpipe.loading.config import WorkerSettings

# a budget for every trial of both engines (2 + 2 rungs, 2 prefetch) at the shortest window
QUICK = ["--budget", "8", "--max-workers", "2", "--batch-size", "8", "--image-size", "32"]


def _trial(
    num_workers: int,
    prefetch_factor: int | None = 2,
    *,
    engine: str = "processes",
    samples_per_s: float = 0.0,
) -> tune_search.Trial:
    settings = WorkerSettings(
        num_workers=num_workers, prefetch_factor=prefetch_factor, engine=engine
    )
    return tune_search.Trial(settings, samples_per_s=samples_per_s)


@pytest.mark.slow
def test_bench_loader_reports_saves_and_make_loader_uses_it(make_dataset, capsys, caplog) -> None:
    path = make_dataset("hdf5")
    plot = os.path.join(path, "..", "trials.png")
    assert main(["bench-loader", path, *QUICK, "--json", "--plot", plot]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["stages"]
    assert stages["read"] >= stages["decode"] >= stages["transform"] >= stages["collate"] > 0
    processes = [t["num_workers"] for t in report["trials"] if t["engine"] == "processes"]
    assert processes[:2] == [2, 0]  # from the core count (2 here: the --max-workers cap) down
    assert {t["engine"] for t in report["trials"]} == {"processes", "threads"}
    for trial in report["trials"]:  # the loading process and its workers, per sample
        assert trial["cpu_us_per_sample"] > 0 and 0 < trial["first_batch_s"] < 60, trial
    assert report["bottleneck"] in {"read", "decode", "transform", "collate"}
    assert report["advice"].split(":")[0].endswith("bound")
    assert report["saved"] == os.path.join(path, "dlpipe-profiles.json")
    assert os.path.getsize(plot) > 0
    best = report["best"]
    caplog.set_level("INFO", logger="dlpipe")
    loader = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=8, image_size=32))
    threads = best["engine"] == "threads"
    assert loader.num_workers == (0 if threads else best["num_workers"])
    assert (loader._stages.threads is not None) == threads
    assert "using loader profile" in caplog.text


def test_the_search_respects_the_ram_budget(make_dataset, monkeypatch) -> None:
    """1 GB a worker, 1.6 GB to spend: the climb's start (the core count, 2 here) would not
    fit, so it moves down to the main process; threads are never skipped."""
    monkeypatch.setattr(tune_search, "available_memory", lambda: 2 * 10**9)
    monkeypatch.setattr(tune_search, "_own_memory", lambda: 10**9)  # the guess before a worker ran
    monkeypatch.setattr(tune_search, "_worker_rss", lambda: 10**9)  # 1 GB whatever the workers
    monkeypatch.setattr(tune_search, "usable_cpus", lambda: 2)
    monkeypatch.setattr(tune_search, "run_trial", lambda config, trial, seconds: _fake(trial))
    config = tune_stages.BenchConfig(path=make_dataset("lmdb"), max_workers=4)
    trials = tune_search.search(config)
    skipped = [t for t in trials if t.skipped]
    assert skipped and skipped[0].settings.num_workers == 2 and "GB" in skipped[0].skipped
    processes = [t for t in trials if t.settings.engine == "processes" and not t.skipped]
    assert [t.settings.num_workers for t in processes] == [0]
    threads = [t.settings.num_workers for t in trials if t.settings.engine == "threads"]
    assert set(threads) == {1, 2, 3, 4}  # threads share one process's memory: none skipped


def test_a_measured_worker_size_replaces_the_guess(make_dataset, monkeypatch) -> None:
    """The guess (this process's size) lets 2 workers start; measured at 1.5 GB each, 3 and
    4 would not fit in 4 GB, and the climb stops up the ladder there."""
    monkeypatch.setattr(tune_search, "available_memory", lambda: 5 * 10**9)
    monkeypatch.setattr(tune_search, "_own_memory", lambda: 10**8)
    monkeypatch.setattr(tune_search, "_worker_rss", lambda: 15 * 10**8)
    monkeypatch.setattr(tune_search, "usable_cpus", lambda: 2)
    monkeypatch.setattr(tune_search, "run_trial", lambda config, trial, seconds: _fake(trial))
    trials = tune_search.search(tune_stages.BenchConfig(path=make_dataset("lmdb"), max_workers=4))
    processes = [
        (t.settings.num_workers, bool(t.skipped))
        for t in trials
        if t.settings.engine == "processes"
    ]
    assert processes[:3] == [(2, False), (3, True), (0, False)], processes


@pytest.mark.parametrize(
    ("cores", "peak", "expected"),
    [(16, 12, [16, 24, 8, 20, 12]), (2, 3, [2, 3, 0, 4]), (48, 96, [48, 72, 32, 96, 84])],
)
def test_the_climb_starts_at_the_core_count_and_finds_the_peak(
    cores: int, peak: int, expected: list[int]
) -> None:
    """Rates rise to `peak` workers and fall past it: the climb measures the core count
    first, its neighbours, moves to the faster, and refines halfway; it ends on the peak
    (16 cores: 12 lies between ladder rungs 8 and 16 and is found by the refinement, after
    20 on the faster side)."""
    order: list[int] = []

    def run(trial: tune_search.Trial, seconds: float) -> tune_search.Trial:
        n = trial.settings.num_workers
        trial.samples_per_s = 1000.0 if n == 0 else 500.0 * min(n, peak) - 100.0 * max(n - peak, 0)
        order.append(n)
        return trial

    counts = tune_search._worker_counts(2 * cores, cores)
    ladder = [_trial(n, 2 if n else None) for n in counts if n != 1]
    best = tune_search._climb(run, ladder, cores, tune_search._Budget(60.0))
    assert best.settings.num_workers == peak
    assert order[: len(expected)] == expected, order
    assert len(order) <= 6  # a handful of trials, not the ladder


def test_the_ladder_doubles_to_the_core_count_then_grows_by_half() -> None:
    assert tune_search._worker_counts(4, 2) == [0, 1, 2, 3, 4]
    assert tune_search._worker_counts(32, 16) == [0, 1, 2, 4, 8, 16, 24, 32]
    assert tune_search._worker_counts(8, 16) == [0, 1, 2, 4, 8]
    assert tune_search._worker_counts(1, 2) == [0, 1]


def test_the_search_ends_within_its_budget_on_a_machine_with_many_cores(
    make_dataset, monkeypatch
) -> None:
    """48 cores: a ladder of 10 worker counts per engine. Each trial measures for its share
    of the time left and pays 0.2 s to start; more workers are always faster here, so only
    the budget ends the climb. The search's clock is a fake one that each trial moves on by
    what it would take, so the bound holds exactly, however busy the machine."""
    clock = [0.0]
    windows: list[float] = []
    starts: list[float] = []

    def fake(config, trial, seconds):
        starts.append(clock[0])
        windows.append(seconds)
        clock[0] += seconds + 0.2
        trial.samples_per_s = 100.0 * (trial.settings.num_workers + 1)
        return trial

    monkeypatch.setattr(tune_search, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(tune_search, "usable_cpus", lambda: 48)
    monkeypatch.setattr(tune_stages, "usable_cpus", lambda: 48)  # its max_workers default
    monkeypatch.setattr(tune_search, "run_trial", fake)
    config = tune_stages.BenchConfig(path=make_dataset("lmdb"), budget_s=4.0)
    trials = tune_search.search(config)
    assert all(start < 4.0 for start in starts[1:]), starts  # none begun once it was spent
    assert clock[0] <= 4.0 + 0.5 + 0.2 + 1e-9, clock[0]  # past it by one short trial at most
    assert all(0.5 <= w <= 10.0 for w in windows)
    assert (
        trials[0].settings.num_workers == 48 and len(trials) < 14
    )  # the core count first; cut short
    assert {t.settings.engine for t in trials} == {"processes", "threads"}  # each engine its share


def test_the_search_keeps_the_faster_engine_and_tunes_its_prefetch(make_dataset, monkeypatch):
    """Threads measured faster (as with no IPC): the best trial, its prefetch and the saved
    profile are the thread engine's; measured slower, the workers stay."""

    def fake(config, trial, seconds, threads_gain):
        gain = threads_gain if trial.settings.engine == "threads" else 1.0
        rate = 100.0 * min(trial.settings.num_workers, 2) * gain
        trial.samples_per_s = rate + 10 * (trial.settings.prefetch_factor or 0)
        return trial

    path = make_dataset("lmdb")
    for gain, engine in ((1.5, "threads"), (0.8, "processes")):
        monkeypatch.setattr(tune_search, "run_trial", lambda c, t, s, g=gain: fake(c, t, s, g))
        config = tune_stages.BenchConfig(path=path, max_workers=4)
        trials = tune_search.search(config)
        best = max(trials, key=lambda t: t.samples_per_s)
        assert (
            best.settings.engine == engine
            and best.settings.num_workers == 2
            and best.settings.prefetch_factor == 8
        )
        report = tune.BenchReport(config=config, stages=None, trials=trials, best=best)  # type: ignore[arg-type]
        with open(tune.save_winner(report)) as f:
            profile = json.load(f)["profiles"][-1]
        assert (profile["engine"], profile["num_workers"]) == (engine, 2)


def _fake(trial: tune_search.Trial) -> tune_search.Trial:
    trial.samples_per_s = 100.0 * (trial.settings.num_workers + 1)
    trial.worker_rss_bytes = tune_search._worker_rss() * trial.settings.num_workers
    return trial


def test_verdict_names_the_stage_that_costs_most() -> None:
    stages = tune_stages.StageRates(
        read=10_000, decode=500, transform=450, collate=440, read_mb_per_s=900
    )
    best = _trial(2, samples_per_s=800)
    stage, advice = verdicts.verdict(stages, best, cores=2, image_size=224)
    assert stage == "decode" and "--max-side 448" in advice
    slow_read = tune_stages.StageRates(
        read=100, decode=95, transform=94, collate=93, read_mb_per_s=5
    )
    stage, advice = verdicts.verdict(slow_read, best, cores=2, image_size=224)
    assert stage == "read" and "NVMe" in advice


@pytest.mark.parametrize(("installed", "crop_decode", "advised"), [
    (False, True, True), (True, True, False), (False, False, False),
])  # fmt: skip
def test_a_decode_bound_train_loader_without_region_decode_is_told_how_to_get_it(
    installed: bool, crop_decode: bool, advised: bool, monkeypatch
) -> None:
    monkeypatch.setattr(turbojpeg, "_library", [object() if installed else None])
    stages = tune_stages.StageRates(read=10_000, decode=500, transform=450, collate=440,
                             read_mb_per_s=900, crop_decode=crop_decode)  # fmt: skip
    _, advice = verdicts.verdict(stages, _trial(2, samples_per_s=800), 2, 224)
    assert ("pip install 'dlpipe[jpeg-region]'" in advice) is advised, advice


@pytest.mark.parametrize(("share", "crop_decode", "advised"), [
    (0.0, True, True), (1.0, True, False), (0.0, False, False),
])  # fmt: skip
def test_a_decode_bound_train_loader_on_plain_jpegs_is_told_to_make_them_seekable(
    share: float, crop_decode: bool, advised: bool, monkeypatch
) -> None:
    monkeypatch.setattr(turbojpeg, "_library", [object()])
    stages = tune_stages.StageRates(read=10_000, decode=500, transform=450, collate=440,
                             read_mb_per_s=900, crop_decode=crop_decode,
                             seekable_share=share)  # fmt: skip
    _, advice = verdicts.verdict(stages, _trial(2, samples_per_s=800), 2, 224)
    assert ("--seekable-jpeg" in advice) is advised, advice


def test_the_stage_table_counts_the_seekable_jpegs(tmp_path) -> None:
    """bench-loader's stage measurement sees whether the dataset was converted seekable."""
    from test_jpeg_seek import needs_library, photo, write_raw

    if needs_library.args[0]:
        pytest.skip(needs_library.kwargs["reason"])
    raw = tmp_path / "raw"
    for i in range(12):
        write_raw(raw / "ab"[i % 2] / f"{i}.jpg", photo(120, 90, seed=i))
    shares = []
    for extra in ((), ("seekable_jpeg",)):
        out = tmp_path / f"out{len(extra)}"
        dlpipe.convert(str(raw), to="lmdb", out=str(out), workers=1,
                       **dict.fromkeys(extra, True))  # fmt: skip
        config = tune_stages.BenchConfig(path=str(out), loader=dlpipe.LoaderConfig(batch_size=4))
        shares.append(tune_stages.measure_stages(config, seconds=0.1).seekable_share)
    assert shares == [0.0, 1.0]


@pytest.mark.parametrize(("gpu_gain", "kept"), [(2.0, "GPU decode kept"), (0.5, "CPU decode kept")])
def test_a_gpu_target_measures_gpu_decode_and_the_verdict_says_why(
    gpu_gain, kept, make_dataset, monkeypatch
) -> None:
    def fake(config, trial, seconds):
        gain = gpu_gain if trial.settings.decode == "cuda" else 1.0
        trial.samples_per_s = 100.0 * (min(trial.settings.num_workers, 2) + 1) * gain
        return trial

    monkeypatch.setattr(tune_search, "run_trial", fake)
    monkeypatch.setattr(tune_search.torch.cuda, "is_available", lambda: True)
    config = tune_stages.BenchConfig(path=make_dataset("lmdb"), max_workers=2, device="cuda")
    trials = tune_search.search(config)
    gpu = [t for t in trials if t.settings.decode == "cuda"]
    assert len(gpu) == 1 and gpu[0].settings.pin_memory
    best = max(trials, key=lambda t: t.samples_per_s)
    assert (best.settings.decode == "cuda") == (gpu_gain > 1)
    advice = verdicts.decode_verdict(trials)
    assert advice.startswith(f"; {kept}: decoding each batch on the GPU gave")
    assert f"{gpu_gain:.2f}x" in advice
    assert verdicts.decode_verdict([t for t in trials if t.settings.decode == "cpu"]) == ""


def test_the_stage_table_times_the_loaders_own_crop_aware_decode(make_dataset, monkeypatch):
    """The train recipe's decode stage is the loader's: box first, DCT-scaled JPEG decode,
    never the full decode the old table timed."""
    from dlpipe.loading import transforms as transforms_module

    scales: list[int] = []
    real = transforms_module.decode_jpeg_box

    def recorded(data: bytes, size: tuple[int, int], box, factor: int):
        scales.append(factor)
        return real(data, size, box, factor)

    def no_full_decode(*args, **kwargs):
        raise AssertionError("the train stages decoded a JPEG in full")

    monkeypatch.setattr(transforms_module, "decode_jpeg_box", recorded)
    monkeypatch.setattr(tune_stages, "decode_rgb", no_full_decode)
    loader = dlpipe.LoaderConfig(batch_size=4, image_size=8)
    stages = tune_stages.measure_stages(
        tune_stages.BenchConfig(path=make_dataset("lmdb"), loader=loader), 0.2
    )
    assert stages.read >= stages.decode >= stages.transform >= stages.collate > 0
    assert stages.crop_decode
    assert scales and max(scales) >= 2  # 8 px crops of 64-128 px photos decode scaled


def test_a_trial_with_more_workers_than_cores_warns_nothing(make_dataset) -> None:
    """More workers than cores is what a search tries: torch's warning about it (raised when
    the DataLoader is built and again when it starts its workers) stays out of the report."""
    import warnings

    config = tune_stages.BenchConfig(
        path=make_dataset("lmdb"), loader=dlpipe.LoaderConfig(batch_size=4, image_size=16)
    )
    trial = _trial((os.cpu_count() or 1) + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tune_search.run_trial(config, trial, 0.3)
    assert trial.samples_per_s > 0
    assert not [w for w in caught if "worker" in str(w.message)], [str(w.message) for w in caught]


def test_cpu_seconds_counts_a_busy_child_process() -> None:
    """bench-loader's CPU per sample counts the workers: a child that has spun for 0.3 s of
    CPU shows in `cpu_seconds` while it is alive, though this process only waited."""
    import multiprocessing

    from dlpipe.machine import cpu_seconds

    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: children are not counted here")
    context = multiprocessing.get_context("fork")
    spun, leave = context.Event(), context.Event()
    child = context.Process(target=_spin, args=(0.3, spun, leave))
    before = cpu_seconds()
    child.start()
    try:
        assert spun.wait(60)
        during = cpu_seconds() - before
    finally:
        leave.set()
        child.join(60)
    assert during >= 0.25, during


def _spin(seconds: float, spun, leave) -> None:
    import time

    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    spun.set()
    leave.wait(60)  # alive until measured: a child is counted while it runs


@pytest.mark.parametrize(("engine", "warmed"), [("processes", 17), ("threads", 2)])
def test_a_trial_warms_up_every_worker_process_but_threads_in_one_batch(
    engine: str, warmed: int, monkeypatch
) -> None:
    """16 worker processes each make their first batch before the windows (17 batches);
    16 threads share every batch, so 2 warm them (17 batches of 256 at a GIL-bound 450
    samples/s cost 10 s a trial on 16 cores)."""
    import torch

    drawn: list[int] = []

    def batches():
        while True:
            drawn.append(1)
            yield torch.zeros(4, 1), torch.zeros(4)

    seen: list[int] = []
    monkeypatch.setattr(tune_search, "_worker_rss", lambda: seen.append(len(drawn)) or 0)
    tune_search._measure(batches(), _trial(16, engine=engine), 0.05)
    assert seen[0] == warmed
