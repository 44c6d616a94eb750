"""Build step of the tensoralloc package: bundles libtensoralloc.so and the C/C++ headers.

The library is `$TENSORALLOC_LIB` when set (an already built libtensoralloc.so), else the one
that `cargo build --release` makes from the repository this directory belongs to.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HEADERS = ["tensoralloc.h", "tensoralloc_torch.hpp"]


def cargo_version():
    text = (REPO / "Cargo.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def built_library():
    given = os.environ.get("TENSORALLOC_LIB")
    if given:
        path = Path(given)
        if not path.is_file():
            raise SystemExit(f"TENSORALLOC_LIB={given} is not a file")
        return path
    if not (REPO / "Cargo.toml").is_file():
        raise SystemExit(
            f"{REPO} is not the tensoralloc repository: build from a clone, or set "
            "TENSORALLOC_LIB to a built libtensoralloc.so"
        )
    cargo = shutil.which("cargo")
    if cargo is None:
        raise SystemExit(
            "cargo is needed to build libtensoralloc.so (https://rustup.rs), or set "
            "TENSORALLOC_LIB to a built libtensoralloc.so"
        )
    subprocess.run([cargo, "build", "--release", "--lib"], cwd=REPO, check=True)
    return REPO / "target" / "release" / "libtensoralloc.so"


class BuildWithLibrary(build_py):
    """Copies the library and the headers next to the Python modules."""

    def run(self):
        super().run()
        dest = Path(self.build_lib) / "tensoralloc"
        shutil.copyfile(built_library(), dest / "libtensoralloc.so")
        include = dest / "include"
        include.mkdir(parents=True, exist_ok=True)
        for name in HEADERS:
            shutil.copyfile(REPO / "include" / name, include / name)


class BinaryDistribution(Distribution):
    """The wheel holds a native library, so it is tagged for this platform."""

    def has_ext_modules(self):
        return True


setup(
    version=cargo_version(),
    cmdclass={"build_py": BuildWithLibrary},
    distclass=BinaryDistribution,
)
