"""Packaging: the metadata lives in setup.cfg; this only renames the client on its way in.

The checkout keeps the client as client.py, a file users can copy into their own project.
Installed, that name would be a generic top-level module in site-packages (shadowing, or
shadowed by, a user's own client.py), so the distribution ships it as kcoral_client.py,
which kcoral.py loads by path.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithClient(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file("client.py", os.path.join(self.build_lib, "kcoral_client.py"))


setup(cmdclass={"build_py": BuildPyWithClient})
