"""Everything is declared in pyproject.toml; this only puts the startup hook ``prismlm-transformers.pth``
(packaging/) at the root of the wheel, where site-packages runs it at interpreter start: it lets transformers
know the ``prism`` model type in programs that never import prismlm (see ``prismlm.integrations.hf_auto``).
Editable installs do not carry it; ``scripts/setup.sh`` copies it into site-packages."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = Path("packaging") / "prismlm-transformers.pth"


class BuildPyWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(HOOK), str(Path(self.build_lib) / HOOK.name), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / HOOK.name)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
