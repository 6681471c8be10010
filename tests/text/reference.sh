#!/bin/sh
# Runs reference.js under Node.js, or skips (exit 77, one line) when node is not installed.
# usage: reference.sh hf|gpt2 NODE_MODULES TOKENIZER CORPUS WORK_DIR
command -v node >/dev/null 2>&1 || { echo "skip: node (Node.js) is not installed"; exit 77; }
exec node "$(dirname "$0")/reference.js" "$@"
