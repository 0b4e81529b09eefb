#!/usr/bin/env bash
# The real-model recipe end to end (README's third command): SmolLM2-135M-Instruct learning the
# chat-phrased arithmetic task with N-GRPO on CPU (configs/smollm2_135m_arith.yaml). Every stage
# is skipped when its output exists and training resumes from its run directory: the same command
# again goes on where it stopped. Outputs: runs/smollm2_arith/ (metrics, checkpoints, heldout.png,
# hf_iter_<step>/, logs/ with each stage's whole output), outputs/eval/smollm2_arith_{base,iter_<step>}/.
# The terminal shows the stages, their progress bars and results. Extra arguments are training
# overrides (e.g. train.max_steps=20). Environment:
#   SMOLLM2_RUN: the run directory (default runs/smollm2_arith)
#   SMOLLM2_EVAL_OUT: where the evaluations go (default outputs/eval)
#   SMOLLM2_EVAL_LIMIT: evaluate the first N held-out problems only (default 0: all 192; 192
#     problems x 4 samples x 64 tokens take ~6 minutes on a free core, ~4x that on a busy one)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL="${NGRPO_MODELS:-$HOME/.cache/megatron_ngrpo/models}/SmolLM2-135M-Instruct"
RUN="${SMOLLM2_RUN:-runs/smollm2_arith}"
OUT="${SMOLLM2_EVAL_OUT:-outputs/eval}"
LIMIT="${SMOLLM2_EVAL_LIMIT:-0}"
SIZE="${LIMIT/#0/}"
SIZE="${SIZE:+_first$SIZE}"  # a sized evaluation is kept apart: smollm2_arith_base_first16
CONFIG=configs/smollm2_135m_arith.yaml
EVAL=configs/eval/smollm2_arith.yaml
mkdir -p "$RUN/logs"

# quiet NAME CMD...: CMD's whole output to $RUN/logs/NAME.log, its progress bars to the terminal;
# on failure the log's last lines.
quiet() {
  local log="$RUN/logs/$1.log"
  shift
  "$@" 2>&1 | python3 tools/show_progress.py "$log" || {
    echo "failed: $* (its last lines; all in $log)" >&2
    tail -n 15 "$log" >&2
    exit 1
  }
}

# evaluate NAME DIR [OVERRIDES...]: the held-out evaluation into DIR (skipped when done); its table.
evaluate() {
  local name="$1" dir="$2"
  shift 2
  [[ -f "$dir/results.json" ]] ||
    quiet "$name" python3 -m megatron_ngrpo.eval --config "$EVAL" "limit=$LIMIT" "output_dir=$dir" "$@"
  grep '^| [a-z]' "$dir/summary.md"
}

echo "== 1/6 set-up: the packages (scripts/setup.sh) and the model folder"
bash scripts/setup.sh
bash scripts/setup_real_model.sh

echo "== 2/6 task: the chat-phrased arithmetic problems"
[[ -f runs/arith_chat/heldout.jsonl ]] || python3 -m examples.arithmetic.task --chat runs/arith_chat

echo "== 3/6 baseline: the untrained model on the held-out problems (n = 4, T = 1; % correct, boxed)"
evaluate eval_base "$OUT/smollm2_arith_base$SIZE"

echo "== 4/6 training (resumes from $RUN; log $RUN/logs/train.log)"
quiet train python3 -m megatron_ngrpo.train --config "$CONFIG" "train.run_dir=$RUN" "$@"

LAST=$(cat "$RUN/latest")  # iter_<step> of the last checkpoint: later stages are per checkpoint
echo "== 5/6 held-out curve ($RUN/heldout.png) and evaluation of $LAST"
quiet plot python3 tools/plot_metrics.py "$RUN" --out "$RUN/heldout.png"
evaluate "eval_$LAST" "$OUT/smollm2_arith_$LAST$SIZE" "checkpoint=$RUN/$LAST"

echo "== 6/6 HF export: $RUN/hf_$LAST"
[[ -f "$RUN/hf_$LAST/config.json" ]] ||
  quiet export python3 tools/convert_megatron_to_hf.py --input "$RUN/$LAST" --output "$RUN/hf_$LAST" --hf-source "$MODEL"
echo "done: baseline $OUT/smollm2_arith_base$SIZE/summary.md, trained $OUT/smollm2_arith_$LAST$SIZE/summary.md," \
  "curve $RUN/heldout.png, model $RUN/hf_$LAST"
