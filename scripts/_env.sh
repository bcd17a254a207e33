# Sourced by scripts/test and scripts/demo: create .venv and install the project once.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline} \
       DS_ACCELERATOR=cpu PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
ensure_venv() {
  local stamp=.venv/.installed
  if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv" >&2
    python3 -m venv .venv
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[setup] pip install -e '.[dev]' (about a minute on a fresh machine)" >&2
    .venv/bin/python -m pip install -q -e '.[dev]' 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    touch "$stamp"
  fi
}
