"""The command-line programs installed with the package (the ``cli`` extra brings tqdm for
their progress bars, ``plot`` also matplotlib for the curves):

* ``tengrad-train`` (:mod:`.train`, ``python -m tengrad_fx.cli.train``): one training run
  of a zoo model, its logs and checkpoints (the loop: :mod:`._loop`, :mod:`._checkpoint`;
  ``--distributed``: :mod:`._dist`).
* ``tengrad-reproduce`` (:mod:`.reproduce`): a row of the paper's Table 2, its runs, table
  and curves (:mod:`._runs` reads run directories, :mod:`.plot` draws them).

Importing this package imports none of them.
"""
