#!/usr/bin/env bash
# The SmolLM2-135M-Instruct evaluation report: reports/smollm2/.
#
#   bash benchmarks/smollm2_report.sh [main|sweep|all]     (default: all)
#
# main:  for each position with stores under $STORES/<position>/ (prompt_last; response_last when
#        collected), `hf-lsad evaluate` runs the grid of benchmarks/smollm2_grid.json (FreqMask-KM,
#        Local FreqMask-KM, Mahalanobis, GMM, One-Class SVM, Deep SVDD, CVDD, supervised linear probe;
#        3 seeds; FreqMask-KM ablations) on every unsafe category present (harmful, toxic, jailbreak)
#        with benign_ood as benign-OOD negatives, and writes reports/smollm2/<position>/.
#        Stores: bash benchmarks/collect_smollm2.sh (layer 20).
# sweep: extraction-layer sweep: for each layer store under $STORES/layer_sweep/ (written by
#        python benchmarks/collect_layer_sweep.py), FreqMask-KM and Mahalanobis
#        (benchmarks/smollm2_layer_sweep_grid.json), then benchmarks/summarize_layer_sweep.py writes
#        reports/smollm2/layer_sweep.md.
#
# SAE: d_sae=2304, l1=1.0, 30 epochs (SAETrainConfig), trained on each store's safe fit split and
# cached under $STORES/sae/ (a cached SAE is checked against the split and settings it was trained
# with). In the sweep the L1 coefficient is scaled by the layer's activation RMS relative to
# layer 20 (the penalty must scale with the activations, paper appendix "SAE Training").
set -euo pipefail
stores=${STORES:-artifacts/smollm2}
out=${OUT:-reports/smollm2}
what=${1:-all}
here=$(dirname "$0")

present() {  # folder pool...: the store folders that exist (index.json is written last)
    local dir=$1; shift
    for pool in "$@"; do [ -f "$dir/$pool/index.json" ] && echo "$dir/$pool"; done
    return 0
}

main_report() {
    for position in prompt_last response_last; do
        local dir=$stores/$position
        [ -f "$dir/safe/index.json" ] || continue
        mapfile -t unsafe < <(present "$dir" harmful toxic jailbreak)
        [ ${#unsafe[@]} -gt 0 ] || continue
        local ood=()
        [ -f "$dir/benign_ood/index.json" ] && ood=(--benign-ood "$dir/benign_ood")
        hf-lsad evaluate --safe "$dir/safe" --unsafe "${unsafe[@]}" "${ood[@]}" \
            --grid "$here/smollm2_grid.json" \
            --sae "$stores/sae/$position" --d-sae 2304 --sae-l1 1.0 --sae-epochs 30 \
            --title "SmolLM2-135M-Instruct, layer 20, $position" --out "$out/$position"
    done
}

sweep() {
    local root=$stores/layer_sweep
    for layer_dir in "$root"/layer*; do
        [ -f "$layer_dir/safe/index.json" ] || continue
        local layer=${layer_dir##*/layer}
        mapfile -t unsafe < <(present "$layer_dir" harmful toxic jailbreak)
        [ ${#unsafe[@]} -gt 0 ] || continue
        local ood=()
        [ -f "$layer_dir/benign_ood/index.json" ] && ood=(--benign-ood "$layer_dir/benign_ood")
        local l1
        l1=$(python -c "
from hf_lsad.data.store import load_activations
rms = lambda p: load_activations(p).activations.pow(2).mean().sqrt().item()
print(f'{rms(\"$layer_dir/safe\") / rms(\"$root/layer20/safe\"):.4g}')")
        hf-lsad evaluate --safe "$layer_dir/safe" --unsafe "${unsafe[@]}" "${ood[@]}" \
            --grid "$here/smollm2_layer_sweep_grid.json" \
            --sae "$stores/sae/layer_sweep/layer$layer" --d-sae 2304 --sae-l1 "$l1" --sae-epochs 30 \
            --title "SmolLM2-135M-Instruct layer sweep, layer $layer, prompt_last" --out "$out/layer_sweep/layer$layer"
    done
    python "$here/summarize_layer_sweep.py" "$out/layer_sweep"
}

case $what in
    main) main_report ;;
    sweep) sweep ;;
    all) main_report; sweep ;;
    *) echo "usage: $0 [main|sweep|all]" >&2; exit 2 ;;
esac
