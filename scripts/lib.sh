# Shared helpers for the scripts in this folder.

step() { printf '\n==> %s\n' "$*"; }

# The machine image provides Rust through rustup; fall back to Debian's packages.
ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found; installing Rust from Debian's packages"
    apt-get update -qq && apt-get install -y -qq cargo rustc rustfmt
  fi
  cargo --version
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt 2>/dev/null || true
}
