#!/usr/bin/env bash
# Issue 24, session 5 (2026-12-02): its two device commands, now steps of scripts/gpu_verify6.sh (one set of steps):
#   bash scripts/gpu_verify5.sh A     # single (world-1 GPU tests) eager eager_dec0 probe hostpy       ~330 s
#   bash scripts/gpu_verify5.sh B     # eager tests1 peer layer epb run (needs carry [".whl"])            ~400 s
# or name steps (any of gpu_verify6.sh's).
steps=()
for a in "$@"; do
    case $a in
        A) steps+=(single eager eager_dec0 probe hostpy) ;;
        B) steps+=(eager tests1 peer layer epb run) ;;
        *) steps+=("$a") ;;
    esac
done
exec bash "$(dirname "$0")/gpu_verify6.sh" "${steps[@]}"
