#!/usr/bin/env bash
# Snapshot a commit for the device machine: scratch/clean holds `git archive COMMIT`, the wheels the
# device image lacks (.whl/: tornado, llguidance, gguf, jsonschema and its needs, fetched with the
# `pip download` line in the device tool's README) and bench/device/run.sh as gpu.sh, so helpers'
# uncommitted edits in the working tree stay behind. Add `/scratch/` and `/.whl/` to .git/info/exclude.
# Then, through the device tool: command `cd scratch/clean && KILN_COMMIT=$(cat COMMIT) bash gpu.sh MODE ...`,
# carry ["scratch"]. Usage: bash bench/device/prep.sh [COMMIT]
set -e
cd "$(dirname "$0")/../.."
c=$(git rev-parse --short ${1:-HEAD})
rm -rf scratch/clean && mkdir -p scratch/clean
git archive $c | tar x -C scratch/clean
cp -r .whl scratch/clean/.whl
cp bench/device/run.sh scratch/clean/gpu.sh
echo $c > scratch/clean/COMMIT
echo "snapshot $c"
