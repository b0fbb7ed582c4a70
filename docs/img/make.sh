#!/usr/bin/env bash
# Regenerate the pictures of docs/simulate.md and the README (run from the repository root):
#     bash docs/img/make.sh
# Uses `pipec` from the environment, or .venv/bin/pipec when there is one.
set -euo pipefail
cd "$(dirname "$0")/../.."
PIPEC=${PIPEC:-$( [ -x .venv/bin/pipec ] && echo .venv/bin/pipec || echo pipec )}
OUT=docs/img

# Every library schedule at p=4, m=8 (v=2), default costs, side by side on one time axis.
$PIPEC simulate gpipe 1f1b interleaved-1f1b looped-bfs zb-h1 zb-h2 zb-v dualpipe-v \
    -D p=4 -D m=8 -D v=2 --no-memory --plot $OUT/library-p4-m8.png
# 1F1B and ZB-V at p=8, m=16 with their memory curves.
$PIPEC simulate 1f1b -D p=8 -D m=16 --plot $OUT/1f1b-p8-m16.png
$PIPEC simulate zb-v -D p=8 -D m=16 --mem act=0.5 --mem wact=0.25 --plot $OUT/zb-v-p8-m16.png
# What latency does to 1F1B: messages take 0.3 of a forward.
$PIPEC simulate 1f1b zb-h1 -D p=4 -D m=8 --cost T_F=1,T_B=1,T_W=1,latency=0.3 --no-memory --plot $OUT/latency-p4-m8.png
