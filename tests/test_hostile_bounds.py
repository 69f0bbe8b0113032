"""Numbers out of range, as a typo or an attacker writes them: every train option's bounds (CLI
and TOML, NaN and inf, a TOML nested 100,000 deep), worker counts past what the machine runs,
a saved profile that contradicts its machine, a manifest of 10**6 tiny values, and a thread
engine transform that never returns."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
from conftest import one_error

import dlpipe
from dlpipe import machine
from dlpipe.cli import main
from dlpipe.loading import profile as profiles
from dlpipe.loading.config import LoaderConfig, LoaderConfigError, WorkerSettings
from dlpipe.manifest import MAX_BASE_VALUES, parse_manifest
from dlpipe.train.config import ConfigError, TrainConfig, load_config

TESTS = Path(__file__).resolve().parent
COMMON = ["--model", "trainer_models:tiny_cnn", "--image-size", "16", "--batch-size", "16"]


@pytest.fixture(autouse=True)
def _models(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))


def _train(data: str, out: Path, *extra: str) -> int:
    return main(["train", data, "--out", str(out), *COMMON, *extra])


# --- the train config's numbers -------------------------------------------------------------

BAD_FLAGS = [
    (["--lr", "1e308"], "optim.lr = 1e+308 must be at most 100"),
    (["--lr", "inf"], "optim.lr = inf must be a finite number"),
    (["--lr=-inf"], "optim.lr = -inf must be a finite number"),
    (["--lr", "nan"], "optim.lr = nan must be a finite number"),
    (["--lr", "100.5"], "optim.lr = 100.5 must be at most 100"),
    (["--batch-size", "524288"], "optim.lr = 204.8 must be at most 100 (sgd's default"),
    (["--weight-decay", "1e308"], "optim.weight_decay = 1e+308 must be at most 10"),
    (["--warmup-epochs", "1e308"], "optim.warmup_epochs = 1e+308 must be at most 100000"),
    (["--warmup-epochs=-1e-300"], "optim.warmup_epochs = -1e-300 must not be negative"),
    (["--momentum", "1"], "optim.momentum = 1.0 must be in [0, 1)"),
    (["--clip-grad", "1e-320"], "optim.clip_grad = 1e-320 must be in [1e-06, 1e+06]"),
    (["--clip-grad", "1e308"], "optim.clip_grad = 1e+308 must be in [1e-06, 1e+06]"),
    (["--label-smoothing", "-0.5"], "optim.label_smoothing = -0.5 must be in [0, 1)"),
    (["--dist-timeout", "1e308"], "run.dist_timeout_s = 1e+308 must be in [1, 604800]"),
    (["--dist-timeout", "1e-9"], "run.dist_timeout_s = 1e-09 must be in [1, 604800]"),
    (["--dist-timeout", "0.5"], "run.dist_timeout_s = 0.5 must be in [1, 604800]"),
    (["--dist-timeout", "inf"], "run.dist_timeout_s = inf must be a finite number"),
    (["--epochs", "100000000000"], "run.epochs = 100000000000 must be at most 100000"),
    (["--batch-size", str(2**21)], f"run.batch_size = {2**21} must be at most {2**20}"),
    (["--micro-batch", str(2**21)], f"run.micro_batch = {2**21} must be at most {2**20}"),
    (["--max-steps", str(10**22)], f"run.max_steps = {10**22} must be at most {10**12}"),
    (["--max-steps", "0"], "run.max_steps = 0 must be a positive integer"),
    (["--early-stop-patience", str(10**6)], "run.early_stop_patience = 1000000 must be at most"),
    (["--keep-last", str(10**6)], "run.keep_last = 1000000 must be at most 1000"),
    (["--log-every", str(10**13)], f"run.log_every_steps = {10**13} must be at most"),
    (["--checkpoint-every", str(10**13)], f"run.checkpoint_every_steps = {10**13} must be at"),
    (["--checkpoint-every", "-1"], "run.checkpoint_every_steps = -1 must not be negative"),
    (["--max-nonfinite-steps", str(10**13)], "run.max_nonfinite_steps = 10000000000000 must"),
    (["--seed", str(2**32)], "run.seed = 4294967296 must be in 0.."),
    (["--num-workers", "100000"], "data.num_workers = 100000 is more loader workers than"),
    (["--num-workers", "-1"], "data.num_workers = -1 must not be negative"),
]


@pytest.mark.parametrize(("args", "message"), BAD_FLAGS)
def test_an_out_of_range_flag_is_one_error_line_and_exit_2(
    args, message, make_dataset, tmp_path, capsys
) -> None:
    assert _train(make_dataset("lmdb"), tmp_path / "run", *args) == 2
    assert message in one_error(capsys)
    assert not (tmp_path / "run").exists()  # before any rank, nothing written


BAD_TOML = [
    ("[optim]\nlr = 1e308\n", "optim.lr = 1e+308 must be at most 100"),
    ("[optim]\nlr = inf\n", "optim.lr = inf must be a finite number"),
    ("[optim]\nweight_decay = -inf\n", "optim.weight_decay = -inf must be a finite number"),
    ("[optim]\nwarmup_epochs = 1e308\n", "optim.warmup_epochs = 1e+308 must be at most"),
    ("[optim]\nclip_grad = nan\n", "optim.clip_grad = nan must be a finite number"),
    ("[run]\ndist_timeout_s = 1e308\n", "run.dist_timeout_s = 1e+308 must be in [1, 604800]"),
    ("[run]\ndist_timeout_s = 0.000000001\n", "run.dist_timeout_s = 1e-09 must be in"),
    ("[run]\nepochs = 9223372036854775807\n", "run.epochs = 9223372036854775807 must be at"),
    ("[run]\nmax_steps = 99999999999999999999\n", "run.max_steps = 99999999999999999999 must"),
    ("[data]\nnum_workers = 100000\n", "data.num_workers = 100000 is more loader workers"),
    (
        '[data]\nnum_workers = 100000\nengine = "threads"\n',
        "data.num_workers = 100000 is more loader workers",
    ),
    ("[run]\nepochs = [" + "1, " * 100_000 + "1]\n", "run.epochs = [1, 1, 1, 1, 1"),
    ("[" + "x" * 10_000 + "]\n", "unknown key 'xxxxxxxx"),
    ("[data]\nmin_crop_scale = 1e308\n", "1e+308 is not an area share in (0, 1]"),
    ("[data.loader]\nimage_size = 0\n", "image_size = 0: 0 is not an integer in 1..16384"),
]


@pytest.mark.parametrize(("text", "message"), BAD_TOML, ids=range(len(BAD_TOML)))
def test_an_out_of_range_config_file_is_one_error_line(
    text, message, make_dataset, tmp_path, capsys
) -> None:
    """A run folder's config.toml is a file anyone may have edited."""
    config = tmp_path / "config.toml"
    config.write_text(text)
    assert _train(make_dataset("lmdb"), tmp_path / "run", "--config", str(config)) == 2
    line = one_error(capsys)
    assert message in line and len(line) < 400, line  # a huge value is shown cut
    assert not (tmp_path / "run").exists()


DEEP = 100_000
DEEP_TOML = {
    "arrays": "[run]\nepochs = " + "[" * DEEP + "]" * DEEP + "\n",
    "inline-tables": "[run]\nepochs = " + "{a = " * DEEP + "1" + "}" * DEEP + "\n",
    "mixed": "[run]\nepochs = " + "[{a = " * (DEEP // 2) + "1" + "}]" * (DEEP // 2) + "\n",
    "just-past-the-stack": "[run]\nepochs = " + "[" * 600 + "]" * 600 + "\n",
}


@pytest.mark.parametrize("case", sorted(DEEP_TOML))
def test_a_toml_nested_100000_deep_is_one_error_line(case, make_dataset, tmp_path, capsys):
    config = tmp_path / "config.toml"
    config.write_text(DEEP_TOML[case])
    assert _train(make_dataset("lmdb"), tmp_path / "run", "--config", str(config)) == 2
    assert "nests arrays or tables too deeply" in one_error(capsys)


def test_a_config_that_is_not_a_small_regular_file_is_refused(tmp_path) -> None:
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (1 << 20) + "\n[run]\nepochs = 1\n")
    with pytest.raises(ConfigError, match="is over 1 MiB"):
        load_config(str(big), {})
    with pytest.raises(ConfigError, match="is a character device; give the TOML file"):
        load_config("/dev/zero", {})
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO; give the TOML file"):
        load_config(str(fifo), {})  # would hang on open, with nobody writing
    with pytest.raises(ConfigError, match="is a folder; give the TOML file"):
        load_config(str(tmp_path), {})


def test_every_documented_edge_is_accepted(tmp_path) -> None:
    """The ranges are closed where documented: each edge value itself trains."""
    config = load_config(
        None,
        {
            "data": {"path": str(tmp_path), "num_workers": 0, "min_crop_scale": 1.0},
            "optim": {"lr": 100.0, "weight_decay": 10.0, "warmup_epochs": 100_000.0},
            "run": {"epochs": 100_000, "batch_size": 2**20, "dist_timeout_s": 1.0},
        },
    )
    config.validate()
    edges = {"clip_grad": 1e-6, "momentum": 0.0, "label_smoothing": 0.0}
    load_config(None, {"data": {"path": "x"}, "optim": edges}).validate()
    far = {"dist_timeout_s": 604800.0, "max_steps": 10**12, "keep_last": 1000}
    load_config(None, {"data": {"path": "x"}, "run": far}).validate()
    assert TrainConfig().optim.lr is None  # the derived default is checked after resolution


def test_preflight_refuses_before_torchrun_starts(make_dataset, tmp_path, capsys) -> None:
    """--nproc-per-node checks the numbers once in the launcher: one line, no torchrun."""
    args = ["--nproc-per-node", "2", "--dist-timeout", "1e308"]
    assert _train(make_dataset("lmdb"), tmp_path / "run", *args) == 2
    assert "run.dist_timeout_s = 1e+308" in one_error(capsys)


# --- worker counts --------------------------------------------------------------------------


@pytest.fixture
def small_machine(monkeypatch):
    """A machine of 2 CPUs, 2 GiB free and 1024 open files: 8 process workers at most (CPUs),
    and what each other fact allows when it is set lower."""
    monkeypatch.setattr(machine, "usable_cpus", lambda: 2)
    monkeypatch.setattr(machine, "available_memory", lambda: 2 << 30)
    monkeypatch.setattr(machine, "open_files_limit", lambda: 1024)
    return monkeypatch


def test_the_worker_limit_is_the_tightest_of_cores_memory_and_open_files(small_machine):
    assert machine.worker_limit() == (8, "4 per usable CPU, 2 CPUs")
    small_machine.setattr(machine, "available_memory", lambda: 300 << 20)
    assert machine.worker_limit().workers == 2 and "MiB available" in machine.worker_limit().reason
    assert machine.worker_limit(threads=True).workers == 8  # a thread costs less memory
    small_machine.setattr(machine, "available_memory", lambda: 1 << 40)
    small_machine.setattr(machine, "open_files_limit", lambda: 96)
    assert machine.worker_limit() == (4, "open-files limit 96 (ulimit -n)")
    assert machine.worker_limit(threads=True).workers == 8  # threads open no pipes
    small_machine.setattr(machine, "open_files_limit", lambda: 10)
    small_machine.setattr(machine, "available_memory", lambda: 0)
    assert machine.worker_limit().workers == 1  # never below one


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 8 on the real 2 cores
@pytest.mark.parametrize("engine", ["processes", "threads"])
@pytest.mark.parametrize("count", [9, 100_000, 2**63])
def test_an_explicit_worker_count_the_machine_cannot_run_is_refused(
    engine, count, make_dataset, small_machine
) -> None:
    path = make_dataset("lmdb")
    with pytest.raises(LoaderConfigError, match=rf"num_workers={count} is more .* \(8: 4 per"):
        dlpipe.make_loader(
            path,
            "train",
            dlpipe.LoaderConfig(batch_size=4),
            workers={"num_workers": count, "engine": engine},
        )
    given = WorkerSettings(num_workers=count, engine=engine)
    with pytest.raises(LoaderConfigError, match="pass at most 8"):
        dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=4), workers=given)
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4),
        workers={"num_workers": 8, "engine": engine},
    )
    assert loader.settings.num_workers == 8


def test_the_default_worker_count_is_cut_to_the_machine_with_a_warning(
    make_dataset, small_machine, monkeypatch, caplog
) -> None:
    from dlpipe.loading import config as loader_config

    monkeypatch.setattr(loader_config, "usable_cpus", lambda: 64)  # the defaults ask for 63
    small_machine.setattr(machine, "available_memory", lambda: 300 << 20)
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        loader = dlpipe.make_loader(
            make_dataset("lmdb"), "train", dlpipe.LoaderConfig(batch_size=4), profile=None
        )
    assert loader.num_workers == 2 and loader.settings_line().endswith("(defaults)")
    assert "default num_workers=63 more worker processes than this machine can run" in caplog.text


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"batch_size": 2**21}, "batch_size=2097152 is more than 1048576"),
        ({"image_size": 10**6}, "image_size=1000000 is more than 16384"),
        ({"seed": -1}, "seed=-1 is not an integer in 0..18446744073709551615"),
        ({"seed": 2**64}, "seed=18446744073709551616 is not an integer in 0.."),
        ({"prefetch_factor": 10**9, "num_workers": 1}, "prefetch_factor=1000000000 is not"),
        ({"prefetch_factor": 0, "num_workers": 1}, "prefetch_factor=0 is not None or an"),
    ],
)
def test_loader_numbers_past_what_a_loader_can_run_are_refused(changes, message, make_dataset):
    """A seed numpy refuses, a crop of terabytes, a billion batches' indices queued up front:
    each a named LoaderConfigError before anything runs."""
    config = {k: v for k, v in changes.items() if k in dlpipe.LoaderConfig.__dataclass_fields__}
    workers = {"num_workers": 0, **{k: v for k, v in changes.items() if k not in config}}
    with pytest.raises(LoaderConfigError, match=message.replace("(", r"\(")):
        dlpipe.make_loader(
            make_dataset("lmdb"), "train", dlpipe.LoaderConfig(**config), workers=workers
        )


def test_bench_loader_skips_worker_counts_the_machine_cannot_run(
    make_dataset, small_machine, monkeypatch
) -> None:
    """--max-workers 100000 climbs past the machine: those trials are skipped, named, and
    the search goes on (the loader would refuse them)."""
    from dlpipe.loading import tune_search, tune_stages

    def fake(config, trial, seconds):
        trial.samples_per_s = 100.0 * (trial.settings.num_workers + 1)
        return trial

    monkeypatch.setattr(tune_search, "run_trial", fake)
    trials = tune_search.search(
        tune_stages.BenchConfig(path=make_dataset("lmdb"), max_workers=100_000, budget_s=2.0)
    )
    ran = [t for t in trials if not t.skipped]
    skipped = [t for t in trials if t.skipped]
    assert ran and max(t.settings.num_workers for t in ran) <= 8
    assert skipped and all("more workers than this machine can run" in t.skipped for t in skipped)


# --- saved profiles -------------------------------------------------------------------------

CONFIG = LoaderConfig(batch_size=4, image_size=24)


def _save(path: str, **settings: object) -> None:
    profile = profiles.LoaderProfile(
        settings=WorkerSettings(**{"num_workers": 1, "prefetch_factor": 2, **settings}),
        samples_per_s=100.0,
        machine=profiles.machine_key(),
        loader=profiles.loader_key("train", CONFIG),
    )
    profiles.save_profile(path, profile)


@pytest.fixture
def cpu_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiles, "gpu_name", lambda: "none")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decode": "cuda"}, "asks for decode=cuda, which needs a CUDA GPU, but its machine key"),
        ({"pin_memory": True}, "asks for pin_memory=true, which needs a CUDA GPU"),
        ({"decode": "cuda", "engine": "threads"}, "asks for decode=cuda"),
    ],
)
def test_a_profile_that_contradicts_its_machine_is_a_warning_and_the_defaults(
    settings, message, make_dataset, cpu_machine, caplog
) -> None:
    path = make_dataset("lmdb")
    _save(path, **settings)
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        loader = dlpipe.make_loader(path, config=CONFIG)
        batches = sum(1 for _ in loader)
    assert batches > 0 and loader.settings_line().endswith("(defaults)")
    assert message in caplog.text and "dlpipe-profiles.json" in caplog.text
    assert "default worker settings are used" in caplog.text


def test_a_gpu_profile_for_raw_samples_is_passed_over(make_dataset, monkeypatch, tmp_path, caplog):
    """On a GPU machine, a profile keyed for transform=None that decodes on the GPU (which
    only the image transforms can) would fail every loader: it is advice, passed over."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiles, "gpu_name", lambda: "Test GPU 80GB")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    path, raw = make_dataset("lmdb"), CONFIG.replace(transform=None)
    profile = profiles.LoaderProfile(
        settings=WorkerSettings(num_workers=1, decode="cuda"),
        samples_per_s=100.0,
        machine=profiles.machine_key(),
        loader=profiles.loader_key("train", raw),
    )
    profiles.save_profile(path, profile)
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        loader = dlpipe.make_loader(path, config=raw)
    assert loader.settings_line().endswith("(defaults)") and loader.settings.decode == "cpu"
    assert "asks for decode=cuda with transform 'none'" in caplog.text


@pytest.mark.parametrize("count", [9, 256])
def test_a_profile_asking_for_more_workers_than_the_machine_runs_is_cut(
    count, make_dataset, cpu_machine, small_machine, caplog
) -> None:
    """256 workers on 2 cores (the most a profile file may say): cut to the machine, warned
    (torch's own warning is not shown for a profile's count, so this one must be)."""
    path = make_dataset("lmdb")
    _save(path, num_workers=count)
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        loader = dlpipe.make_loader(path, config=CONFIG)
    assert loader.num_workers == 8 and loader.settings_line().endswith("(profile)")
    assert f"saved profile's num_workers={count} more worker processes" in caplog.text


# --- the manifest's parse -------------------------------------------------------------------


def _manifest_with(path: str, values: str, count: int) -> bytes:
    """The dataset's manifest with `count` copies of `values` in its free-form options."""
    data = json.loads((Path(path) / "dlpipe.json").read_text())
    data["options"]["padding"] = "@"
    text = json.dumps(data, separators=(",", ":"))
    return text.replace('"@"', "[" + ",".join([values] * count) + "]").encode()


@pytest.mark.parametrize("values", ["1", "1.5", '"ab"', "[]", "{}", "null", '"sha256"'])
def test_a_manifest_of_more_values_than_its_shards_hold_is_refused_unparsed(
    values, make_dataset
) -> None:
    """10**8 integers in 200 MB parsed into 8 GB: the count is checked on the bytes first, so
    the refusal costs no more memory than a few counters, whatever the values are."""
    path = make_dataset("lmdb")
    raw = _manifest_with(path, values, MAX_BASE_VALUES + 1000)
    tracemalloc.start()
    try:
        with pytest.raises(dlpipe.ManifestError, match="JSON values .* it was not parsed"):
            parse_manifest(raw, "dlpipe.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_a_manifest_within_the_bound_parses_in_memory_proportional_to_it(make_dataset) -> None:
    """Under the bound, the parse (and the depth check) stays a small multiple of the file."""
    path = make_dataset("lmdb")
    raw = _manifest_with(path, "1", 1_000_000)
    tracemalloc.start()
    try:
        manifest = parse_manifest(raw, "dlpipe.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(manifest.options["padding"]) == 1_000_000
    assert peak < 8 * len(raw), (peak, len(raw))


def test_a_large_real_manifest_is_within_the_bound(tmp_path) -> None:
    """50,000 shards (a 100 TB dataset) and 100,000 classes on two splits parse."""
    shard = {"samples": 1, "bytes": 1, "sha256": "0" * 64}
    shards = [{"name": f"train-{i:06d}.tar", **shard} for i in range(50_000)]
    classes = [f"class{i}" for i in range(100_000)]
    counts = [0] * len(classes)
    counts[0] = len(shards)
    data = {
        "schema": "dlpipe.manifest", "schema_version": 1, "dlpipe_version": "0.1.0",
        "format": "wds", "format_version": 1, "fields": {"jpg": "image", "cls": "int"},
        "classes": classes,
        "splits": {"train": {"samples": len(shards), "bytes": len(shards),
                             "class_counts": counts, "shards": shards}},
        "options": {}, "source": {},
    }  # fmt: skip
    manifest = parse_manifest(json.dumps(data, indent=2).encode(), "dlpipe.json")
    assert len(manifest.splits["train"].shards) == 50_000


# --- a transform that never returns ---------------------------------------------------------

HANGING_LOADER = textwrap.dedent("""
    import sys, threading
    import dlpipe

    def hangs(sample):
        if sample["__key__"] != SAFE:
            threading.Event().wait()  # never returns
        return int(sample["cls"])

    ds = dlpipe.open_dataset(sys.argv[1])
    SAFE = ds[0]["__key__"]
    config = dlpipe.LoaderConfig(batch_size=1, transform=hangs, shuffle=False)
    loader = dlpipe.make_loader(
        sys.argv[1], "train", config, workers={"engine": "threads", "num_workers": 2}, profile=None
    )
    iterator = iter(loader)
    print("first", next(iterator), flush=True)  # later samples' transforms are queued and hang
    loader.close()
    print("closed", flush=True)
""")


def test_a_transform_that_never_returns_does_not_keep_the_process_alive(
    make_dataset, tmp_path
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANGING_LOADER)
    done = subprocess.run(
        [sys.executable, str(script), make_dataset("lmdb")],
        capture_output=True,
        text=True,
        timeout=120,  # a hang is forever; an exit is seconds on any machine
    )
    assert done.returncode == 0, done.stderr
    assert "first" in done.stdout and "closed" in done.stdout


@pytest.mark.parametrize("workers", ["100000", str(2**63)])
def test_convert_workers_past_the_machine_are_one_error_line(tmp_path, capsys, workers) -> None:
    from dlpipe.machine import worker_limit
    from dlpipe.synthetic import split_samples, write_imagefolder

    write_imagefolder(str(tmp_path / "raw"), split_samples(8, seed=1, val_fraction=0.25))
    out = tmp_path / "out"
    command = ["convert", str(tmp_path / "raw"), "--to", "wds", "--out", str(out)]
    assert main([*command, "--workers", workers]) == 2
    line = one_error(capsys)
    assert f"--workers {worker_limit().workers} or fewer" in line and workers in line
    assert not out.exists()
    assert main([*command, "--workers", str(worker_limit().workers)]) == 0
