"""The command line: the typer app, the live view, and exit codes for every error."""
