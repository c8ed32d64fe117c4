"""Build hook: bundle libmoefuse.so into the wheel of `pip install ./python`.

The library is the repository's build/libmoefuse.so (build/cpu/libmoefuse.so for a build
without CUDA); when neither exists this runs
`make -C .. lib` first. An editable install (`pip install -e python`, the documented
path) bundles nothing: the package finds ../build/libmoefuse.so itself at run time.
Without a library the install still succeeds and says so; at run time the package
then needs MOEFUSE_LIB.
"""

import pathlib
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
# The build with CUDA (build/), else the one without (`make NVCC=none`: build/cpu/).
BUILDS = (REPO / "build" / "libmoefuse.so", REPO / "build" / "cpu" / "libmoefuse.so")


def built_library():
    return next((p for p in BUILDS if p.is_file()), None)


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if built_library() is None and (REPO / "Makefile").is_file():
            print(f"moefuse: no {BUILDS[0]} nor {BUILDS[1]}, running `make -C {REPO} lib`")
            result = subprocess.run(["make", "-C", str(REPO), "lib"])
            if result.returncode != 0:
                print("moefuse: WARNING: `make lib` failed; installing without the library "
                      "(set MOEFUSE_LIB at run time)")
        library = built_library()
        if library is not None:
            target = pathlib.Path(self.build_lib) / "moefuse" / library.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library, target)
            print(f"moefuse: bundled {library} -> {target}")
        else:
            print("moefuse: WARNING: no libmoefuse.so under build/; installing without the library "
                  "(set MOEFUSE_LIB at run time)")


class BinaryDistribution(Distribution):
    """The wheel carries a shared library, so it is platform-specific."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
