"""Package discovery with the folder mapping (metadata lives in pyproject.toml).

Everything importable lives under `hangwatch.`: the top-level folders map onto subpackages, so the
installed distribution adds no top-level import name but `hangwatch` (`daemon` and `supervisor` alone
belong to python-daemon and supervisord).  `hangwatch` itself is an implicit namespace.  setuptools'
declarative `packages.find` cannot add the `hangwatch.` prefix, so the packages are found here.
"""

from setuptools import find_packages, setup

FOLDERS = ("common", "daemon", "supervisor")

setup(
    packages=[f"hangwatch.{p}" for p in find_packages(include=[*FOLDERS, *(f"{f}.*" for f in FOLDERS)])],
    package_dir={f"hangwatch.{f}": f for f in FOLDERS},
)
