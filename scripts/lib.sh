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

# Installs Debian packages (the machine image runs as root; CI does too).
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

# Installs the pins of requirements file $2 into virtual environment $1, after upgrading
# pip; skipped when the environment already holds exactly that file's pins (a stamp of
# the file and the interpreter's version).
install_pinned() {
  local venv=$1 requirements=$2 want t=$SECONDS
  local stamp="$venv/.$requirements.sha256"
  want=$({ sha256sum "$requirements"; "$venv/bin/python" --version; } | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    echo "$requirements already installed in $venv"
    return 0
  fi
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q --upgrade pip
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -r "$requirements"
  echo "installed $requirements in $venv in $((SECONDS - t))s"
  echo "$want" >"$stamp"
}

# The oldest CPython sumflow supports: requires-python in pyproject.toml.
min_python=3.10

# The Python environment, in .venv at the repository root, activated for the rest of the
# calling script:
#   1. a virtual environment of python3 (CPython $min_python or newer; Debian's
#      python3-venv is installed if venv is missing);
#   2. the pinned tools of requirements-dev.txt (maturin, setuptools, pytest, ruff, numpy,
#      torch), after upgrading pip; skipped when .venv already holds exactly that file's
#      pins;
#   3. the sumflow package, built by `maturin develop --release`: an editable install (a .pth
#      points at python/, so Python edits need no reinstall) whose extension module is
#      built into python/sumflow/. Cargo rebuilds only what changed, in the workspace's
#      target/ (or $CARGO_TARGET_DIR), sharing the release build of `cargo test --release`;
#   4. the benchmarks, bench/ (the sumflow-bench distribution: sumflow_bench), editable too.
# After a Rust change, run `maturin develop --release` in the activated .venv, or this again.
ensure_python_env() {
  local venv=.venv started=$SECONDS
  if ! command -v python3 >/dev/null 2>&1; then
    echo "python3 not found; installing it from Debian's packages"
    apt_install python3 python3-venv
  fi
  if ! python3 -c "import sys; sys.exit(sys.version_info < tuple(map(int, '$min_python'.split('.'))))"; then
    echo "$(python3 --version) is older than sumflow supports (CPython $min_python or newer);" \
      "put a newer python3 first on PATH" >&2
    return 1
  fi
  if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    if ! python3 -m venv "$venv"; then
      echo "python3 cannot create a virtual environment; installing python3-venv"
      rm -rf "$venv"
      apt_install python3-venv
      python3 -m venv "$venv"
    fi
  fi
  export VIRTUAL_ENV=$PWD/$venv
  export PATH="$VIRTUAL_ENV/bin:$PATH"
  unset PYTHONHOME
  python --version

  install_pinned "$venv" requirements-dev.txt

  local t=$SECONDS
  maturin develop --release --locked
  # With the setuptools pinned in requirements-dev.txt and without resolving dependencies:
  # everything sumflow-bench needs is pinned there or is the sumflow just installed, so this
  # needs no index (and could never fetch some other project's "sumflow" from one).
  python -m pip install --disable-pip-version-check --progress-bar off -q \
    --no-build-isolation --no-deps --editable bench
  echo "built and installed sumflow and sumflow-bench in $((SECONDS - t))s (python environment: $((SECONDS - started))s)"
}

# A CPython $min_python: python$min_python on PATH, else one of pyenv's. Prints its path,
# or nothing where there is none.
oldest_python() {
  local p
  for p in "$(command -v "python$min_python" || true)" \
    "${PYENV_ROOT:-$HOME/.pyenv}/versions/$min_python".*/bin/"python$min_python"; do
    if [ -x "$p" ] && "$p" -c 'import ensurepip, venv' 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
}

# A second environment, .venv-torch-oldest, of the oldest Python and the oldest torch
# release sumflow supports (oldest_python; requirements-torch-oldest.txt, reinstalled only
# when that file or the interpreter changes) with the sumflow wheel built from this tree,
# installed unchanged: what a user with an older Python and torch gets from the one wheel.
# Needs ensure_python_env first (maturin). Prints the environment's python.
ensure_oldest_torch_env() {
  local venv=.venv-torch-oldest wheels=$1 started=$SECONDS python version
  python=$(oldest_python)
  if [ -z "$python" ]; then
    python=python3
    echo "warning: no CPython $min_python (the oldest sumflow supports) on PATH or under pyenv;" \
      "this environment uses $(python3 --version), and Python $min_python goes untested" >&2
  fi
  version=$("$python" -c 'import sys; print(sys.version.split()[0])')
  if [ "$("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)" != "$version" ] \
    || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
  fi
  install_pinned "$venv" requirements-torch-oldest.txt >&2
  maturin build --release --locked --out "$wheels" >&2
  "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q \
    --no-deps --force-reinstall "$wheels"/sumflow-*.whl >&2
  echo "$venv: Python $version, $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'), set up in $((SECONDS - started))s" >&2
  echo "$PWD/$venv/bin/python"
}

# What the emulated-cluster benchmark (python -m sumflow_bench.cluster) needs besides root:
# ip and tc from iproute2 for the namespaces and shaping, iperf3 for its link check.
ensure_cluster_tools() {
  if command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 \
    && command -v iperf3 >/dev/null 2>&1; then
    return 0
  fi
  apt_install iproute2 iperf3
}
