"""The ``tritonep`` command line: run, bench, plan, env."""
