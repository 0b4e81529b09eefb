# Sourced by the GPU scripts: on a machine without megatron-core (a lent GPU machine without
# network) the carried .whl/*.whl are installed into /tmp/site, not into the system, and put on
# PYTHONPATH with the checkout; elsewhere the checkout is put first on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null && ! python3 -c "import megatron.core" 2>/dev/null; then
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  else  # a venv without pip: a wheel is a zip of its site-packages files
    for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false CUDA_DEVICE_MAX_CONNECTIONS=1
