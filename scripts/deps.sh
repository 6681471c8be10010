# Sourced by scripts/test, scripts/demo and scripts/bench: installs the Debian packages the build
# needs when any is missing (apt-get; through sudo when not root). Nothing else is assumed.
# libopenmpi-dev and openmpi-bin: tapegrad::dist and mpirun (data parallelism; its tests run under mpirun).
TAPEGRAD_DEPS=(cmake ninja-build g++ pkg-config libopenblas-openmp-dev catch2 nlohmann-json3-dev libcli11-dev libbenchmark-dev
               libopenmpi-dev openmpi-bin)

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
