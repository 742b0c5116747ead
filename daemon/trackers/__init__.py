"""The experiment-tracker runs (W&B, MLflow, TensorBoard) of a hangwatch run; the record format is
`hangwatch.common.trackers`.

    hooks.py   in the training process: every attempt joins the first attempt's tracker run, and a step an earlier
               attempt logged is not logged again (`TrackerHooks`, installed by the automatic instrumentation)
    report.py  a helper the supervisor runs with the worker's interpreter, by path: incidents, restarts and goodput
               on those runs

Standard library only: the hooks patch the tracker modules they are handed at import and import none; report.py
imports nothing of hangwatch.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ()
