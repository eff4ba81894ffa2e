"""The ``autofit`` command: parser (``app.py``), model specs (``specs.py``), rendering (``render.py``)."""
