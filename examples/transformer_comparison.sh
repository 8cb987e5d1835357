#!/usr/bin/env bash
# The paper's comparison on trainable transformers (issue 10, item 5), end to end on real MNIST:
# train a softmax ViT, a linearized-attention ViT and a 2-layer ReLU net of similar size with
# the same recipe, then audit all three with malleability (static, finetune and retrain
# protocols, controls) and landscape. Writes JSON reports and figures into OUT.
#
#   bash examples/transformer_comparison.sh [DATA_DIR] [OUT]     (about 30-40 min on 2 CPU cores)
set -euo pipefail
DATA_DIR=${1:-../shared/data}
OUT=${2:-transformer-comparison}
mkdir -p "$OUT"
AA="attnaudit --threads 1"
D=(--dataset mnist --split test --data-dir "$DATA_DIR")
# One recipe for all three (Adam 1e-3, batches of 64, 5 epochs, cross-entropy), so that only the
# architecture differs; ReLU width 90 gives 71,460 parameters against the ViTs' 71,946.
RECIPE=(--optimizer adam --lr 1e-3 --batch-size 64 --epochs 5 --loss ce --seed 0)
$AA train --arch relu --width 90 "${D[@]}" "${RECIPE[@]}" --out "$OUT/relu.safetensors" --json "$OUT/train_relu.json" --overwrite -q
$AA train --arch vit "${D[@]}" "${RECIPE[@]}" --out "$OUT/vit.safetensors" --json "$OUT/train_vit.json" --overwrite -q
$AA train --arch vit-linear "${D[@]}" "${RECIPE[@]}" --out "$OUT/vit-linear.safetensors" --json "$OUT/train_vit-linear.json" --overwrite -q
MODELS=(--checkpoint "$OUT/relu.safetensors" --checkpoint "$OUT/vit.safetensors" --checkpoint "$OUT/vit-linear.safetensors")
AUDIT=(--n-train 1000 --n-test 300 --top-k 100 --attacks pgd,fgsm,mim,random --eps 0.1,0.3)
$AA malleability "${MODELS[@]}" "${D[@]}" "${AUDIT[@]}" --seeds 5 --protocol static \
    --json "$OUT/mall_static.json" --png "$OUT/mall_static.png" --overwrite -q
$AA malleability "${MODELS[@]}" "${D[@]}" "${AUDIT[@]}" --seeds 3 --protocol finetune --finetune-steps 100 \
    --json "$OUT/mall_finetune.json" --png "$OUT/mall_finetune.png" --overwrite -q
$AA malleability "${MODELS[@]}" "${D[@]}" "${AUDIT[@]}" --seeds 3 --protocol retrain \
    --json "$OUT/mall_retrain.json" --png "$OUT/mall_retrain.png" --overwrite -q
$AA landscape "${MODELS[@]}" "${D[@]}" --n-train 1000 \
    --json "$OUT/landscape.json" --png "$OUT/landscape.png" --overwrite -q
echo "reports in $OUT"
