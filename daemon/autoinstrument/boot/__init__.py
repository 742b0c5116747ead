"""hangwatch's bootstrap directory: the folder the supervisor puts first on a worker's PYTHONPATH
(`common.instrumentation.BOOT_DIR`), so that every Python process of the worker imports its
`sitecustomize.py` at start-up.  This file only makes it a package, so wheels ship the folder."""
