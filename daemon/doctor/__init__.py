"""`hangwatch doctor CONFIG`: a preflight of the built-in worker that runs in seconds on a CPU (and uses the
GPU when there is one), so that the mistakes users' checklists list are caught before hours on a GPU.

    findings.py     Finding (OK / WARN / FAIL / SKIP, the fix in one line) and the exit code
    text_checks.py  tokenizer special tokens, chat template, data counts, a decoded example, labels (no torch)
    plan_checks.py  LR and schedule, device placement, disk for retention, py-spy and ptrace (no torch)
    memory.py       parameter counts on the meta device, the training-peak estimate, device memory
    model_checks.py forward/backward, batch padding, time-boxed generate and eos reachability
    runner.py       the cheap and full sets, each check time-boxed
    render.py       rich table, --json, --plain (what `hangwatch run` echoes)

Every check runs the worker's own code (data.load_tokenizer / validate_file, model.load_model / wrap_lora,
trainer.schedule.WarmupCosine, evaluate.generate_one), not a re-implementation of it.
"""

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("data", "evaluate", "model", "peerlink", "standby_worker", "submit", "trainer")
