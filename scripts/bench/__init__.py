"""The hangwatch benchmark, one module per section (see __main__.py for what it measures and how to run it).

Importable as `bench` with scripts/ on sys.path (tests do that); `python scripts/bench` runs it."""
