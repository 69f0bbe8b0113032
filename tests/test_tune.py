"""dlpipe bench-loader: stages, a short search, the verdict, the saved profile, the RAM budget."""

from __future__ import annotations

import json
import os

import pytest

import dlpipe
from dlpipe.cli import main
from dlpipe.loading import tune

QUICK = ["--budget", "2", "--max-workers", "2", "--batch-size", "8", "--image-size", "32"]


@pytest.mark.slow
def test_bench_loader_reports_saves_and_make_loader_uses_it(make_dataset, capsys, caplog) -> None:
    path = make_dataset("hdf5")
    plot = os.path.join(path, "..", "trials.png")
    assert main(["bench-loader", path, *QUICK, "--json", "--plot", plot]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["stages"]
    assert stages["read"] >= stages["decode"] >= stages["transform"] >= stages["collate"] > 0
    assert [t["num_workers"] for t in report["trials"]][:3] == [0, 1, 2]
    assert report["bottleneck"] in {"read", "decode", "transform", "collate"}
    assert report["advice"].split(":")[0].endswith("bound")
    assert report["saved"] == os.path.join(path, "dlpipe-profiles.json")
    assert os.path.getsize(plot) > 0
    best = report["best"]
    caplog.set_level("INFO", logger="dlpipe")
    loader = dlpipe.make_loader(path, "train", batch_size=8, image_size=32)
    assert loader.num_workers == best["num_workers"]
    assert "using loader profile" in caplog.text


def test_the_search_respects_the_ram_budget(make_dataset, monkeypatch) -> None:
    monkeypatch.setattr(tune, "available_memory", lambda: 2 * 10**9)
    monkeypatch.setattr(tune, "_worker_rss", lambda: 10**9)  # 1 GB whatever the workers
    monkeypatch.setattr(tune, "run_trial", lambda config, trial, seconds: _fake(trial))
    config = tune.BenchConfig(path=make_dataset("lmdb"), max_workers=4)
    trials = tune.search(config)
    skipped = [t for t in trials if t.skipped]
    assert skipped and skipped[0].num_workers == 2 and "GB" in skipped[0].skipped
    assert all(t.num_workers <= 1 for t in trials if not t.skipped)


def _fake(trial: tune.Trial) -> tune.Trial:
    trial.samples_per_s = 100.0 * (trial.num_workers + 1)
    trial.worker_rss_bytes = tune._worker_rss() * trial.num_workers
    return trial


def test_verdict_names_the_stage_that_costs_most() -> None:
    stages = tune.StageRates(read=10_000, decode=500, transform=450, collate=440, read_mb_per_s=900)
    best = tune.Trial(2, 2, False, samples_per_s=800)
    stage, advice = tune.verdict(stages, best, cores=2, image_size=224)
    assert stage == "decode" and "--max-side 448" in advice
    slow_read = tune.StageRates(read=100, decode=95, transform=94, collate=93, read_mb_per_s=5)
    stage, advice = tune.verdict(slow_read, best, cores=2, image_size=224)
    assert stage == "read" and "NVMe" in advice
