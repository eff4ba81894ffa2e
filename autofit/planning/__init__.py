"""The planner's stages beyond the request (``autofit.plan`` composes them: autofit/planner.py): the race of the
layouts (``race.py``) and one layout's climb up its ladder to a finished plan (``climb.py``)."""
