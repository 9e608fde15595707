"""Subcommands that extend the `pymlxc` CLI.

Each module in this package defines `register_commands(register)`, where `register` takes a
`pymlxc.cli.Command`; the CLI imports every module here when it starts (keep their top-level
imports light: import heavy parts inside `run`). Other packages can do the same through the
`pymlxc.commands` entry-point group, whose objects are such `register_commands` functions.
"""
