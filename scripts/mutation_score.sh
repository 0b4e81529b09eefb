#!/usr/bin/env bash
# The core's mutation score (issue #45 item 3): mutmut 3 over the mixing, GRPO and neighbour
# source modules, each mutant judged by the fast single-process unit tests that reach it
# (bench/results/mutation_score.md has the scores). Not part of the default test run: minutes per
# module on one core.
#
#   bash scripts/mutation_score.sh                      # every module, smallest first
#   bash scripts/mutation_score.sh grpo/kl mixing/records   # some modules (paths under megatron_ngrpo/)
#
# It works in a copy of the checkout (MUTATION_WORK, default /tmp/ngrpo-mutation: tracked and
# untracked files, no build outputs), one worker, niced, and prints killed/survived per module.
# Re-running resumes: mutmut keeps each mutant's verdict in $MUTATION_WORK/mutants until the
# source or the tests change.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${MUTATION_WORK:-/tmp/ngrpo-mutation}
ALL=(grpo/kl mixing/arithmetic grpo/advantages training/neighbor_source grpo/mismatch grpo/loss
    mixing/records grpo/update mixing/decision grpo/dra mixing/embedding)
MODULES=("$@")
[ ${#MODULES[@]} -gt 0 ] || MODULES=("${ALL[@]}")
# The fast unit tests of these modules; left out: the torchrun cases (their module fixtures launch
# 2-8 ranks) and the trainer runs.
TESTS=(tests/test_grpo.py tests/test_mismatch.py tests/test_mixing_arithmetic.py tests/test_dra.py
    tests/test_mixing.py tests/test_neighbor_source.py tests/test_core_values.py)
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
    echo "pytest_add_cli_args = -p no:cacheprovider"
    echo "pytest_add_cli_args_test_selection ="
    printf '    %s\n' "${TESTS[@]}" -k "$DESELECT"
} >setup.cfg
unset PYTHONPATH
export OMP_NUM_THREADS=1
start=$(date +%s)
for m in "${MODULES[@]}"; do
    t0=$(date +%s)
    nice -n 10 python3 -m mutmut run --max-children 1 "megatron_ngrpo.${m//\//.}.*" >"mutmut_${m//\//_}.log" 2>&1 || {
        echo "$m: mutmut failed (log: $WORK/mutmut_${m//\//_}.log)"
        continue
    }
    echo "$m: done in $(($(date +%s) - t0)) s"
done
python3 -m mutmut results --all true >results.txt
python3 "$ROOT/scripts/mutation_table.py" results.txt "${ALL[@]}"
echo "total time: $(($(date +%s) - start)) s; commit $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD || echo ' (with local changes)'); mutmut $(python3 -c 'import importlib.metadata as m; print(m.version("mutmut"))')"
