#!/bin/bash
# Wall seconds of two `small` runs at V = 16k (seeds 0 and 1, the quality study's settings),
# without and then with a JAX compilation cache, as sims/quality.py keeps one in --work; prints
# the second seed without a cache over the second seed with a warm one. Needs the study's prose
# tokenizer (TOK, default /work/quality/tok-builtin-prose: sims/quality.py --work /work/quality).
set -euo pipefail
cd "$(dirname "$0")/.."
TOK=${TOK:-/work/quality/tok-builtin-prose}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--model small --heads 16384 --tokenizer "$TOK" --corpus builtin-prose --max-bytes 8m
        --steps 99 --batch 8 --seq-len 128 --eval-tokens 32k --checkpoint-every 200)
declare -A secs
for cache in none warm; do
  for seed in 0 1; do
    env=()
    [[ $cache == warm ]] && env=(JAX_COMPILATION_CACHE_DIR="$tmp/cache")
    start=$(date +%s.%N)
    env "${env[@]}" python cli.py train "${common[@]}" --seed "$seed" --out "$tmp/$cache-$seed" > /dev/null 2>&1
    secs[$cache-$seed]=$(python -c "print(round($(date +%s.%N) - $start, 1))")
    echo "cache $cache, seed $seed: ${secs[$cache-$seed]} s"
  done
done
python -c "print('seed 1 without a cache / with the cache seed 0 filled: %.3f' % (${secs[none-1]} / ${secs[warm-1]}))"
