"""The configuration: one declarative record per key, and everything generated from it.

    schema.py         the records (type, default, bounds, doc) and FAULT_KINDS
    yamldoc.py        YAML → data and the line of every key; duplicate keys refused
    rules.py          rules across settings (errors) and likely mistakes (advice), pure
    slurm.py          a Slurm job's node count, rendezvous and node name (`worker.nnodes: auto`), pure
    deep.py           checks against this machine: data files, model, command, directories
    (the shape of one training example lives in `hangwatch.common.example_shape`)
    errors.py         ConfigError and `FILE:LINE: dotted.key: message`
    load.py           YAML → Config with line-numbered, did-you-mean errors; path resolution; dump;
                      `load_checked` = load + deep checks (validate-config, run)
    reference.py      the docs/configuration.md table and the `run --help` reference, from the records

Import from here (`from hangwatch.common.config import Config, load_config`); the split is internal.
"""

from hangwatch.common.config.errors import ConfigError
from hangwatch.common.config.load import (
    dump_config,
    load_checked,
    load_config,
    parse_config,
    resolve_paths,
    script_name,
)
from hangwatch.common.config.reference import reference_markdown, reference_rows, reference_text
from hangwatch.common.config.schema import (
    FAULT_KINDS,
    CheckpointCfg,
    Config,
    ControlCfg,
    DataCfg,
    EvalCfg,
    EvalPrompt,
    FaultCfg,
    LoggingCfg,
    LoraCfg,
    ModelCfg,
    RestartCfg,
    Section,
    TinyModelCfg,
    TrainCfg,
    WatchdogCfg,
    WorkerCfg,
)

__all__ = [
    "FAULT_KINDS",
    "CheckpointCfg",
    "Config",
    "ConfigError",
    "ControlCfg",
    "DataCfg",
    "EvalCfg",
    "EvalPrompt",
    "FaultCfg",
    "LoggingCfg",
    "LoraCfg",
    "ModelCfg",
    "RestartCfg",
    "Section",
    "TinyModelCfg",
    "TrainCfg",
    "WatchdogCfg",
    "WorkerCfg",
    "dump_config",
    "load_checked",
    "load_config",
    "parse_config",
    "reference_markdown",
    "script_name",
    "reference_rows",
    "reference_text",
    "resolve_paths",
]

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("example_shape", "gpus")
