#!/usr/bin/env bash
# The real-model recipe end to end (README's third command): SmolLM2-135M-Instruct learning the
# chat-phrased arithmetic task with N-GRPO on CPU (configs/smollm2_135m_arith.yaml). Every stage
# is skipped when its output exists and training resumes from its run directory: the same command
# again goes on where it stopped. Outputs: runs/smollm2_arith/ (metrics, checkpoints, heldout.png,
# hf_iter_<step>/), outputs/eval/smollm2_arith_{base,iter_<step>}/. Extra arguments are training overrides
# (e.g. train.max_steps=20).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODEL="${NGRPO_MODELS:-$HOME/.cache/megatron_ngrpo/models}/SmolLM2-135M-Instruct"
RUN=runs/smollm2_arith
CONFIG=configs/smollm2_135m_arith.yaml
EVAL=configs/eval/smollm2_arith.yaml

echo "== 1/6 set-up: the packages (scripts/setup.sh) and the model folder"
bash scripts/setup.sh
bash scripts/setup_real_model.sh

echo "== 2/6 task: the chat-phrased arithmetic problems"
[[ -f runs/arith_chat/heldout.jsonl ]] || python3 examples/arithmetic/task.py --chat runs/arith_chat

echo "== 3/6 baseline: the untrained model on the 192 held-out problems (mean@4, format rate)"
[[ -f outputs/eval/smollm2_arith_base/results.json ]] || \
  python3 -m megatron_ngrpo.eval --config "$EVAL" output_dir=outputs/eval/smollm2_arith_base

echo "== 4/6 training (resumes from $RUN)"
python3 -m megatron_ngrpo.train --config "$CONFIG" "train.run_dir=$RUN" "$@"

LAST=$(cat "$RUN/latest")  # iter_<step> of the last checkpoint: later stages are per checkpoint
echo "== 5/6 held-out curve and evaluation of $LAST"
python3 tools/plot_metrics.py "$RUN" --out "$RUN/heldout.png"
[[ -f "outputs/eval/smollm2_arith_$LAST/results.json" ]] || \
  python3 -m megatron_ngrpo.eval --config "$EVAL" "checkpoint=$RUN/$LAST" "output_dir=outputs/eval/smollm2_arith_$LAST"

echo "== 6/6 HF export: $RUN/hf_$LAST"
[[ -f "$RUN/hf_$LAST/config.json" ]] || \
  python3 tools/convert_megatron_to_hf.py --input "$RUN/$LAST" --output "$RUN/hf_$LAST" --hf-source "$MODEL"
echo "done: baseline outputs/eval/smollm2_arith_base/summary.md, trained outputs/eval/smollm2_arith_$LAST/summary.md," \
     "curve $RUN/heldout.png, model $RUN/hf_$LAST"
