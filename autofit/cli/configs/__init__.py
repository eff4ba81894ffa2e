"""The fine-tuner's front door: a training config of axolotl, LLaMA-Factory, torchtune, TRL / Hugging Face
``TrainingArguments`` or torchtitan, read into one typed value (:mod:`~autofit.cli.configs.value`), planned or checked
on a card (:mod:`~autofit.cli.configs.run`), and written back with only what the plan changes
(:mod:`~autofit.cli.configs.writeback`). One module per framework holds its reader and its keys' spelling of a plan,
each citing the framework's source for what its keys mean; :mod:`~autofit.cli.configs.detect` tells them apart."""
