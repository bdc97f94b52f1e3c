"""The tuner's inference half: the serving model and its search (``model``), the engines' fitted constants
(``engines``, fitted by ``fit`` to the published measurements of ``anchors``), the report (``report``), the measured
runs (``probe``, ``empirical``, ``empirical_report``) over the core's session, and the ``inference`` subcommand
(``cli``).  docs/tuner.md, "Serving a trained model"."""
