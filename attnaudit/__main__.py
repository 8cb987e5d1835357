"""`python -m attnaudit` runs the CLI."""

from attnaudit.cli import main

main()
