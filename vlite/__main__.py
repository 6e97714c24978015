"""``python -m vlite`` runs the command-line interface."""

from vlite.cli.main import main

main()
