"""The `run` and `bench` commands (python -m common run --help)."""


def add_commands(sub):
    pass
