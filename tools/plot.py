"""``python -m tools.plot`` from the repository root: :mod:`tengrad_fx.cli.plot`."""
from tengrad_fx.cli.plot import main

if __name__ == "__main__":
    main()
