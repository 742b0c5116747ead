"""`python -m hangwatch.supervisor …` is the `hangwatch` command (same wiring, for environments without the script)."""
from hangwatch.supervisor.cli import main

main()
