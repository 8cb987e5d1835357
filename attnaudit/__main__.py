"""`python -m attnaudit` runs the CLI."""

from .cli import main

main()
