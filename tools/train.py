"""``python -m tools.train`` from the repository root: the installed ``tengrad-train``
(:mod:`tengrad_fx.cli.train`)."""
from tengrad_fx.cli.train import main

if __name__ == "__main__":
    main()
