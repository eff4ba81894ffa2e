"""``python -m autofit``: the ``autofit`` command."""

from autofit.cli.app import main

if __name__ == "__main__":
    main()
