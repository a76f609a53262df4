"""The wheel carries prebuilt kernels: building it runs ``python -m cukernels.build`` into the wheel's package.

Metadata lives in setup.cfg. The hook compiles every kernel entry point for the shipped GPU architectures with
NVRTC (no GPU needed; nvidia-cuda-nvrtc-cu12 is a build requirement in pyproject.toml) into
``cukernels/_prebuilt/``: about five minutes on two cores, once per source change (binaries already in the source
tree's ``cukernels/_prebuilt/`` under the same key are reused). Editable installs skip it (a checkout compiles
each kernel on first use, or runs ``python -m cukernels.build`` itself); so does ``CUKERNELS_PREBUILT=0``.
"""
import os
import shutil
import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class build_py_with_kernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("CUKERNELS_PREBUILT", "1") == "0":
            return
        # cukernels.build, cukernels._loader and cukernels._nvrtc import only the standard library: load them
        # without running the package's __init__ (which needs NumPy and ml_dtypes, absent from the build env).
        pkg = types.ModuleType("cukernels")
        pkg.__path__ = [str(HERE / "cukernels")]
        sys.modules.setdefault("cukernels", pkg)
        from cukernels import build as kbuild

        if not kbuild._nvrtc.available():
            print("warning: libnvrtc not found in the build environment; the wheel ships no prebuilt kernels "
                  "(each kernel is then compiled on first use)", file=sys.stderr)
            return
        out = Path(self.build_lib) / "cukernels" / "_prebuilt"
        local = HERE / "cukernels" / "_prebuilt"
        if local.is_dir() and local.resolve() != out.resolve():  # reuse what a checkout already built
            out.mkdir(parents=True, exist_ok=True)
            for f in local.glob("*.cubin"):
                shutil.copy2(f, out / f.name)
            if (local / "index.json").is_file():
                shutil.copy2(local / "index.json", out / "index.json")
        index = kbuild.build(out)
        errors = [e for recs in index.values() for r in recs.values() for e in r.get("errors", [])]
        if errors:
            raise SystemExit("kernel build failed:\n" + "\n".join(errors))


setup(cmdclass={"build_py": build_py_with_kernels})
