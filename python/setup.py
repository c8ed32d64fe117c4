"""Build hook: bundle libmoefuse.so into the wheel of `pip install ./python`.

The library is the repository's build/libmoefuse.so; when it is missing this runs
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
LIBRARY = REPO / "build" / "libmoefuse.so"


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if not LIBRARY.is_file() and (REPO / "Makefile").is_file():
            print(f"moefuse: {LIBRARY} missing, running `make -C {REPO} lib`")
            result = subprocess.run(["make", "-C", str(REPO), "lib"])
            if result.returncode != 0:
                print("moefuse: WARNING: `make lib` failed; installing without the library "
                      "(set MOEFUSE_LIB at run time)")
        if LIBRARY.is_file():
            target = pathlib.Path(self.build_lib) / "moefuse" / LIBRARY.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(LIBRARY, target)
            print(f"moefuse: bundled {LIBRARY} -> {target}")
        else:
            print(f"moefuse: WARNING: {LIBRARY} not found; installing without the library "
                  "(set MOEFUSE_LIB at run time)")


class BinaryDistribution(Distribution):
    """The wheel carries a shared library, so it is platform-specific."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
