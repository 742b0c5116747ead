"""Continuous mode, the worker's side (`data.inbox: true`): files dropped into `<run_dir>/inbox/` are
taken in, trained in order, and recorded once a checkpoint covers them.

    intake.py   Inbox: watch → settle → assess → queue/ or rejected/
    assess.py   what is wrong with a file (also `hangwatch submit`'s pre-check)
    publish.py  how a writer puts a file into the inbox so that it is only ever seen complete
    source.py   ContinuousSource: training order, position, restore, commit
    files.py    the files in training (loaded, cached), rejection at training time, leftovers
    position.py a checkpoint's data position: checks and the frontier it stands for
    ledger.py   done/ledger.jsonl and done/replay.jsonl: read (torn tail cut), append, trim
    replay.py   counter-based draws and the pool replays are drawn from
    feed.py     the trainer's data source over all of it, with the intake and idle phases
    idle.py     what the idle wait does after a quiet spell: flush (a partial step) or end

The stages and names of the files are `hangwatch.common.inbox_layout` (the supervisor reads them too).
Nothing here imports torch; the worker hands in a `validator(path) -> (examples, problems)` that
knows the tokenizer.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("data",)
