"""Command-line subcommands."""
