"""The training loop and what it saves (`python -m hangwatch.daemon` builds a `loop.Trainer`).

loop.py          Trainer: run / train_step / after_step / evaluate / flush / finish
state.py         what a checkpoint holds (weights, optimizer, scheduler, RNG) and putting it back
confirmation.py  checkpoints waiting to be confirmed good, provisional ones, an idle run's, retention
schedule.py      the learning-rate schedule
remediation.py   the micro-batch the supervisor chose after an out-of-memory failure, read at start
recovery.py      recovery in the process: the last good state held in memory, the abandon order's watch, the ladder
memory_evidence.py  the device memory figures an out-of-memory failure's last words carry (weights' share, peak, cap)
quarantine.py    training examples kept out after non-finite losses
ranks.py         each rank's share of a step's examples
trackers.py      `train.report_to`: W&B, MLflow, TensorBoard runs on rank 0, behind the scripts' tracker hooks
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = (
    "autoinstrument",
    "checkpoint",
    "data",
    "distributed",
    "evaluate",
    "export",
    "model",
    "resume_compat",
    "trackers",
    "worker_errors",
)
