#!/usr/bin/env bash
# The core's mutation score (issue #45 item 3): mutmut 3 over the mixing, GRPO and neighbour
# source modules, each mutant judged by the fast single-process unit tests that reach it
# (bench/results/mutation_score.md has the scores). Not part of the default test run: minutes per
# module on one core.
#
#   bash scripts/mutation_score.sh                          # every module
#   bash scripts/mutation_score.sh grpo/kl mixing/records   # some (paths under megatron_ngrpo/)
#   bash scripts/mutation_score.sh --resume                 # the mutants without a verdict
#   bash scripts/mutation_score.sh --survivors              # the survived / no-tests ones again
#
# It works in a copy of the checkout (MUTATION_WORK, default /tmp/ngrpo-mutation: tracked and
# untracked files, no build outputs) with one worker, niced, and prints the per-module table
# (scripts/mutation_table.py) over every verdict kept in $MUTATION_WORK/mutants, the surviving
# mutants' names (`cd $MUTATION_WORK && python3 -m mutmut show NAME` shows one's diff), the time,
# commit and mutmut version. The modules named are run again in full; the others keep their
# verdicts. --resume continues a stopped run; --survivors reruns the mutants no test killed, with
# the tests as they are now (after tests were added for them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${MUTATION_WORK:-/tmp/ngrpo-mutation}
ALL=(grpo/kl mixing/arithmetic grpo/advantages training/neighbor_source grpo/mismatch grpo/loss
    mixing/records grpo/update mixing/decision grpo/dra mixing/embedding)
MODE=modules
case "${1:-}" in --resume | --survivors) MODE=${1#--} && shift ;; esac
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=("${ALL[@]}")
MODULES=("${MODULES[@]//\//.}")
MODULES=("${MODULES[@]/%/.*}")
MODULES=("${MODULES[@]/#/megatron_ngrpo.}")
# The fast unit tests of these modules; left out: the torchrun cases (their module fixtures launch
# 2-8 ranks) and the trainer runs.
TESTS=(tests/test_grpo.py tests/test_mismatch.py tests/test_mixing_arithmetic.py tests/test_dra.py
    tests/test_mixing.py tests/test_neighbor_source.py tests/test_core_values.py
    tests/test_core_values_embedding.py tests/test_core_values_grpo.py tests/test_core_values_dra.py
    tests/test_core_values_mixing.py)
DESELECT="not match_float64_reference and not fused_logprob_pass and not policy_hidden_means \
and not tp_dp_equals_bruteforce and not mixing_embedding_ and not model_with_mixes \
and not decision_vocab_parallel and not baselines_vocab_parallel and not records_replay_through \
and not validation_then_training"

mkdir -p "$WORK"
# Sync the checkout into the work copy (mutmut's own state under mutants/ survives).
(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 tar -c) | tar -x -C "$WORK"
cd "$WORK"
# The suite's pytest.ini puts the checkout first on sys.path, where the unmutated package is:
# here the mutated copy (mutants/, which has the tests, data and helpers too) takes its place.
sed 's/^pythonpath = \.$/pythonpath = mutants/' "$ROOT/pytest.ini" >pytest.ini
{
    echo "[mutmut]"
    echo "source_paths = megatron_ngrpo"
    echo "only_mutate ="
    for m in "${ALL[@]}"; do echo "    megatron_ngrpo/$m.py"; done
    echo "also_copy ="
    printf '    %s\n' pytest.ini data bench examples
    # Each mutant's tests run in a child forked from a server that imported pytest and the tests
    # but ran none: a child of the process that ran the stats pass inherits its gloo groups and
    # hangs in the first collective or new group (every mutant reached by an in-process
    # init_distributed test then "timed out", killed or not).
    echo "process_isolation = forkserver"
    # A mutant's wall-time limit is (the tests' time in the stats pass + this) x 15: on a loaded
    # machine a test that sets up a process group overran mutmut's 1 s default, killed or not.
    echo "timeout_constant = 10"
    echo "pytest_add_cli_args = -p no:cacheprovider"
    echo "pytest_add_cli_args_test_selection ="
    printf '    %s\n' "${TESTS[@]}" -k "$DESELECT"
} >setup.cfg
unset PYTHONPATH
export OMP_NUM_THREADS=1
start=$(date +%s)
# One mutmut run for all the modules named: its clean run, forced-fail check and test listing
# cost minutes on a loaded machine, once instead of per module.
case $MODE in
resume) MODULES=() ;; # mutmut skips the mutants that have a verdict unless they are named
survivors)
    mapfile -t MODULES < <(python3 -m mutmut results --all true |
        sed -n 's/^ *\(.*\): \(survived\|no tests\)$/\1/p')
    [ ${#MODULES[@]} -gt 0 ] || { echo "no survivors to rerun" && exit 0; }
    ;;
esac
nice -n 10 python3 -m mutmut run --max-children 1 "${MODULES[@]}" >mutmut.log 2>&1 ||
    echo "mutmut failed (log: $WORK/mutmut.log)"
python3 -m mutmut results --all true >results.txt
python3 "$ROOT/scripts/mutation_table.py" results.txt "${ALL[@]}"
echo "total time: $(($(date +%s) - start)) s; commit $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD || echo ' (with local changes)'); mutmut $(python3 -c 'import importlib.metadata as m; print(m.version("mutmut"))')"
