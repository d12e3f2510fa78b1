"""Policy training: the GRPO loss family, SFT warm start, trainer and stages.

Modules (imported explicitly; this package imports nothing so ``flywheel.config`` stays torch-free):
``objective`` (loss knobs, ``TrainConfig.objective``), ``advantages``, ``losses``, ``data``,
``trainer``, ``sft``, ``stage`` (``train_grpo`` / ``train_sft``, what the CLI and flows call).
"""
