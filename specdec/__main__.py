"""``python -m specdec``: the command line."""

from specdec.cli import main

main()
