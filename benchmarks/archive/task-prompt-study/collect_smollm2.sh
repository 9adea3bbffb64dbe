#!/usr/bin/env bash
# Collect SmolLM2-135M-Instruct activations (layer 20) for the bundled pools.
# Usage: bash benchmarks/collect_smollm2.sh [OUT_DIR]   (default: artifacts/smollm2)
# prompt_last: every safe prompt, every harmful prompt, seeded subsets of the others. The 8,059 safe
# prompts took 35 minutes on a 2-core CPU (the forward pass stops after layer 20).
# Jailbreaks: 100 at prompt_last (batch 4: they run to thousands of tokens; 14 minutes on a quiet
# 2-core CPU), none at response_last (generating after such prompts was too slow there).
# response_last: seeded subsets (64 greedy new tokens per prompt).
set -euo pipefail
out=${1:-artifacts/smollm2}
layer=20
collect() {  # position pool limit
    local dir="$out/$1/$2"
    [ -f "$dir/index.json" ] && return 0
    hf-lsad collect --pool "$2" ${3:+--limit "$3"} --layer $layer --position "$1" --batch-size "$4" --out "$dir"
}
collect prompt_last safe "" 32
collect prompt_last harmful "" 32
collect prompt_last toxic 500 32
collect prompt_last benign_ood 500 32
collect response_last safe 800 16
collect response_last harmful 150 16
collect response_last toxic 96 16
collect response_last benign_ood 96 16
collect prompt_last jailbreak 100 4
