"""The offline table's data, one module per model family; :mod:`autofit.cli.hf_checkpoints` gathers and indexes it.

Each entry is a :class:`~autofit.cli.checkpoints.entry.Checkpoint`: the Hub id, the family it is listed under, the
keyword arguments of ``transformers.AutoConfig.for_model`` copied from the checkpoint's ``config.json``, and the other
Hub ids (instruct / chat / deduped variants, legacy short ids) whose ``config.json`` builds the same model.
"""
