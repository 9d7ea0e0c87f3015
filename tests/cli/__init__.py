"""The tritonep command line: subcommands, --routing files, world sizes."""
