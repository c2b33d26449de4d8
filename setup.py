"""Build of fusedmlp: the Python package, its kernel templates as package data, and the C core as fusedmlp._core.

Metadata lives in pyproject.toml; this file holds what needs code: the C sources (every csrc/*.c, globbed at build
time) and the layout mapping. Set FUSEDMLP_SANITIZE=1 to build the core with AddressSanitizer and UBSan (the Python
that loads it then needs LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
"""

import glob
import os

import numpy
from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def c_sources():
    """Every C file of the core, relative to this folder (setuptools rejects absolute source paths in sdists)."""
    sources = sorted(glob.glob(os.path.join(HERE, "csrc", "*.c")))
    if not sources:
        raise RuntimeError(f"no C sources in {os.path.join(HERE, 'csrc')}: is this a complete checkout?")
    return [os.path.relpath(path, HERE) for path in sources]


def sanitizer_flags():
    """Compile and link flags for the sanitizer CI variant, or none."""
    if os.environ.get("FUSEDMLP_SANITIZE", "") == "1":
        return ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    return []


core = Extension(
    "fusedmlp._core",
    sources=c_sources(),
    depends=sorted(os.path.relpath(path, HERE) for path in glob.glob(os.path.join(HERE, "csrc", "*.h"))),
    include_dirs=["csrc", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")],
    libraries=["dl", "pthread", "m"],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"] + sanitizer_flags(),
    extra_link_args=sanitizer_flags(),
)

setup(
    # kernel_templates/ stays at the top of the repository (DESIGN.md) and installs as fusedmlp/kernel_templates/.
    package_dir={"": "python", "fusedmlp.kernel_templates": "kernel_templates"},
    packages=find_packages("python") + ["fusedmlp.kernel_templates"],
    package_data={"fusedmlp.kernel_templates": ["*.cu", "*.cuh"]},
    ext_modules=[core],
)
