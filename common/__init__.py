"""hangwatch.common — what the worker and the supervisor agree on.

Config schema and loading, the heartbeat wire protocol, exit codes, the run-dir layout, the inbox
layout and one durable write. It imports neither `hangwatch.daemon` nor `hangwatch.supervisor`, and
never torch: both sides import it, it imports neither (tests/unit/test_import_contract.py).
"""
