"""The ``autofit`` command: parser (``app.py``; the flags it shares, ``flags.py``), model specs (``specs.py``),
rendering (``render.py``)."""
