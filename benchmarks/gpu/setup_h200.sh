#!/usr/bin/env bash
# Prepare a GPU machine without a package index (an H200 host) for phloem.
#
# Here (a machine with a package index), in the repository root:
#     benchmarks/gpu/setup_h200.sh download      # wheels into .whl/ (kept out of git)
# There, at the start of every command, in the repository root:
#     source benchmarks/gpu/setup_h200.sh install
#
# "install" puts carried wheels (if .whl/ travelled) into $HOME/site and makes the source tree
# importable as phloem.* (runtime/ -> phloem.runtime, ...) through a small import hook in the
# interpreter's site-packages: the repository's own phloem/ folder would otherwise shadow an
# installed phloem, and tests/ (a package) puts the repository root first on sys.path.

_phloem_download() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
      pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 \
      msgspec==0.23.0 orjson==3.13.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
      typing-inspection==0.4.5 opentelemetry-api==1.45.2 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
      llguidance==1.9.1 gguf==0.19.0 outlines-core==0.2.14 interegular==0.3.3 jsonschema==4.26.0 \
      referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
}

_phloem_install() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$HOME/site" .whl/*.whl
        export PYTHONPATH="$HOME/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    local site_dir
    site_dir=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cat > "$site_dir/_phloem_source_tree.py" <<PY
import sys
from importlib.util import spec_from_file_location

ROOTS = {"phloem": "phloem", "phloem.runtime": "runtime", "phloem.grammars": "grammars",
         "phloem.lang": "lang", "phloem.bench": "benchmarks", "phloem.training": "training"}
TREE = "$PWD"


class SourceTreeFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = ROOTS.get(fullname)
        if folder is None:
            return None
        where = f"{TREE}/{folder}"
        return spec_from_file_location(fullname, f"{where}/__init__.py", submodule_search_locations=[where])


sys.meta_path.insert(0, SourceTreeFinder())
PY
    echo "import _phloem_source_tree" > "$site_dir/_phloem_source_tree.pth"
    python3 -c "import phloem.runtime.attention.registry as r; print('phloem.runtime from', r.__file__)"
}

case "${1:-}" in
    download) _phloem_download ;;
    install) _phloem_install ;;
    *) echo "usage: $0 download|install" >&2 ;;
esac
