#!/usr/bin/env bash
# The tests that once raced the clock, run RUNS times in a row (default 20) while busy loops
# keep every core loaded (one per core, or BUSY of them), stopping at the first failure.
# Each of them waits for the state it needs (a hold file, a journal entry, a handled signal),
# so a loaded machine only makes them slower.
#
#   tests/stress_timing.sh [RUNS] [convert|train|all] [pytest args...]
#
# convert: the conversion interrupts and kills, held by DLPIPE_TEST_HOLD, and the checks that
#          replaced wall-clock bounds (a few minutes a run on 2 loaded cores);
# train:   the training runs stopped by signals (several minutes a run on 2 loaded cores).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:-20}
which=${2:-convert}
shift $(($# < 2 ? $# : 2))

convert=(
    "tests/test_hostile_cli.py::test_ctrl_c_to_the_main_process_is_one_line_and_resumable"
    "tests/test_hostile_cli.py::test_ctrl_c_to_the_process_group_is_one_line_and_resumable"
    "tests/test_hostile_cli.py::test_ctrl_c_to_the_process_group_with_worker_processes"
    "tests/test_hostile_cli.py::test_header_reading_decodes_no_pixels"
    "tests/test_convert.py::test_kill_9_then_resume_gives_the_same_dataset"
    "tests/test_hostile_output.py::test_a_second_convert_while_one_runs_fails_at_once_naming_the_holder"
    "tests/test_hostile_output.py::test_sigkill_of_the_main_process_takes_its_workers_down"
    "tests/test_hostile_output.py::test_a_worker_killed_mid_run_is_one_error_and_resume_finishes"
    "tests/test_tune.py::test_the_search_ends_within_its_budget_on_a_machine_with_many_cores"
    "tests/test_machine.py::test_proportional_set_size_counts_live_processes_and_skips_gone_ones"
    "tests/test_thread_engine.py::test_threads_start_no_process_and_close_ends_their_threads"
    "tests/test_device_decode.py::test_the_next_batch_decodes_on_a_background_thread_while_this_one_is_used"
)
train=(
    "tests/test_hostile_train.py::test_a_stop_signal_to_the_whole_process_group_checkpoints_and_resumes"
    "tests/test_hostile_train.py::test_more_signals_during_a_checkpoint_write_never_abandon_it"
    "tests/test_hostile_train.py::test_a_stop_signal_during_start_up_is_one_line_without_a_traceback"
    "tests/test_hostile_train.py::test_killing_the_launcher_leaves_no_rank_training"
    "tests/test_hostile_train.py::test_a_hung_rank_is_a_named_timeout_not_a_silent_wait"
    "tests/test_hostile_train.py::test_loader_workers_ignore_stop_signals_from_others_and_end_on_their_parents"
    "tests/test_train.py::test_sigterm_checkpoints_exits_zero_and_the_run_resumes_exactly"
    "tests/test_train_signals.py::test_a_hung_rank_ends_the_run_after_dist_timeout_naming_it"
)
case $which in
    convert) tests=("${convert[@]}") ;;
    train) tests=("${train[@]}") ;;
    all) tests=("${convert[@]}" "${train[@]}") ;;
    *) echo "error: the set is convert, train or all, not '$which'" >&2 && exit 2 ;;
esac

busy=()
cleanup() { [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 "${BUSY:-$(nproc)}"); do
    python3 -c "while True: pass" &
    busy+=($!)
done

start=$(date +%s)
for i in $(seq 1 "$runs"); do
    if ! python -m pytest -q -x -p no:cacheprovider "${tests[@]}" "$@"; then
        echo "stress: run $i of $runs FAILED after $(($(date +%s) - start)) s" >&2
        exit 1
    fi
    echo "stress: run $i of $runs passed ($(($(date +%s) - start)) s so far)"
done
echo "stress: $runs/$runs runs passed in $(($(date +%s) - start)) s, ${#busy[@]} busy loops on $(nproc) cores"
