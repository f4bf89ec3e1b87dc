"""``python -m tools.reproduce`` from the repository root: the installed
``tengrad-reproduce`` (:mod:`tengrad_fx.cli.reproduce`)."""
from tengrad_fx.cli.reproduce import main

if __name__ == "__main__":
    main()
