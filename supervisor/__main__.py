"""`python -m hangwatch.supervisor …` is the `hangwatch` command (same wiring, for environments without the script)."""

from hangwatch.supervisor.cli.main import main

main()
