"""The configuration: one declarative record per key, and everything generated from it.

    schema.py     the records (type, default, bounds, doc) and FAULT_KINDS
    load.py       YAML → Config with line-numbered, did-you-mean errors; path resolution; dump
    reference.py  the README table and the `run --help` reference, from the records

Import from here (`from hangwatch.common.config import Config, load_config`); the split is internal.
"""
from hangwatch.common.config.load import ConfigError, dump_config, load_config, parse_config, resolve_paths
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
    "FAULT_KINDS", "CheckpointCfg", "Config", "ConfigError", "ControlCfg", "DataCfg", "EvalCfg", "EvalPrompt",
    "FaultCfg", "LoggingCfg", "LoraCfg", "ModelCfg", "RestartCfg", "Section", "TinyModelCfg", "TrainCfg",
    "WatchdogCfg", "WorkerCfg", "dump_config", "load_config", "parse_config", "reference_markdown",
    "reference_rows", "reference_text", "resolve_paths",
]
