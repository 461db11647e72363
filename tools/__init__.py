"""Experiments, benchmarks and the load tester: above trainer/ and serving/, never imported by them.
The second distribution of the repository, slc-lab (tools/pyproject.toml), outside the server's wheel."""

LAB_INSTALL = "pip install ./tools"  # slc-lab with its dependencies, from the slc checkout (slc/cli.py says the same)


def require(module: str) -> None:
    """Fail before the work when a dependency slc-lab brings (matplotlib, schemathesis, ...) is missing."""
    import importlib.util

    import click

    if importlib.util.find_spec(module) is None:
        raise click.ClickException(f"this command needs {module}, which this install lacks: {LAB_INSTALL} "
                                   "(from the slc checkout)")
