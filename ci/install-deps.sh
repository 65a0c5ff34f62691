#!/usr/bin/env bash
# Install the system packages and cargo tools that building and testing ferry needs
# on a fresh Debian 12 or Ubuntu 24.04 machine. Idempotent: does nothing when everything is
# present (an installed cargo-nextest of another release is kept).
#
#   ci/install-deps.sh            system packages (apt, as root) and cargo tools
#   ci/install-deps.sh --tools    cargo tools only (Open MPI, hwloc, libclang from elsewhere)
set -euo pipefail

# The cargo-nextest release the tests run under (pinned: its minimum Rust moves with each
# release).
NEXTEST_VERSION=0.9.143

install_tools() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "install-deps: cargo not found. Install a Rust toolchain (stable, 1.88 or later, with" >&2
        echo "install-deps: rustfmt and clippy) from rustup, then open a new shell or run: . \"\$HOME/.cargo/env\"" >&2
        exit 1
    fi
    if ! cargo nextest --version >/dev/null 2>&1; then
        echo "install-deps: installing cargo-nextest $NEXTEST_VERSION" >&2
        cargo install cargo-nextest --locked --version "$NEXTEST_VERSION"
    fi
}

case "${1:-}" in
    --tools)
        install_tools
        exit 0
        ;;
    "") ;;
    *)
        echo "install-deps: unknown argument '$1' (usage: ci/install-deps.sh [--tools])" >&2
        exit 2
        ;;
esac

PACKAGES=(libopenmpi-dev openmpi-bin mpich libmpich-dev libclang-dev libhwloc-dev libudev-dev pkg-config procps gcc g++ make)

if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "install-deps: dpkg-query not found; this script supports Debian/Ubuntu only." >&2
    echo "install-deps: install the equivalents of: ${PACKAGES[*]}" >&2
    exit 1
fi

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]} > 0)); then
    echo "install-deps: missing packages: ${missing[*]}" >&2
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "install-deps: not root; run this, then re-run:" >&2
        echo "sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
else
    echo "install-deps: system packages present" >&2
fi

install_tools
