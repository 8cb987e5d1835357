"""`python -m attnaudit` runs the CLI."""

from .cli import app

app()
