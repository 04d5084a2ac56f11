"""Build hooks: ship the start-up ``.pth`` line and the manifest in the wheel.

Metadata lives in setup.cfg.  The ``.pth`` file must land in site-packages for
both ``pip install .`` (wheel root, via build_py) and ``pip install -e .``
(PEP 660 editable wheels only carry what is written to their unpacked root, so
editable_wheel is extended to put it there too).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "drama3_patches.pth"
MANIFEST = "patches_manifest.yaml"


class BuildPyWithHook(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable: the package reads the manifest from the source tree
        shutil.copyfile(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))
        shutil.copyfile(os.path.join(HERE, MANIFEST), os.path.join(self.build_lib, "drama3_patches", MANIFEST))

    def get_outputs(self, include_bytecode=1):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs += [os.path.join(self.build_lib, PTH),
                        os.path.join(self.build_lib, "drama3_patches", MANIFEST)]
        return outputs


cmdclass = {"build_py": BuildPyWithHook}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 has no PEP 660 support
    editable_wheel = None

if editable_wheel is not None:

    class EditableWheelWithHook(editable_wheel):
        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            # Everything in the unpacked root is written into the editable wheel.
            shutil.copyfile(os.path.join(HERE, PTH), os.path.join(str(unpacked_wheel), PTH))
            return result

    cmdclass["editable_wheel"] = EditableWheelWithHook

setup(cmdclass=cmdclass)
