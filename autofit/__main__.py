"""``python -m autofit``: the ``autofit`` command."""

from autofit.cli.app import run

if __name__ == "__main__":
    run()
